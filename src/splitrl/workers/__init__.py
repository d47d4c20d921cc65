"""The workers the controller drives (DESIGN §4), each a Ray actor or an object of the
controller's process: :class:`~splitrl.workers.generation.GenerationWorker` (rollouts and
rewards next to the engine) and :class:`~splitrl.workers.train_actor.TrainActor` (one rank of
the split train step). Bulk tensors go between them through the data plane; the controller
sees ids, rewards and metadata only.

Nothing is imported here: each module loads torch and the model code on import."""
