"""The single controller (DESIGN §4): the asyncio loop of a run (``controller``) and its parts —
where every prompt is (``prompt_schedule``), the replay buffer and its staleness sampler
(``buffer``), the checkpoint lifecycle (``checkpointer``; the on-disk format: ``run_checkpoint``),
the weight-sync path (``weight_sync_path``), a step's metrics (``step_metrics``), the checks
before anything starts (``preflight``), the Ray cluster (``cluster``), where workers run
(``placement``), how they are called (``actors``) and the train workers' client
(``policy_client``). The workers themselves are :mod:`splitrl.workers`."""
