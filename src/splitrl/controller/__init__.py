"""The single controller and its parts (DESIGN §4): replay buffer and sampler (``buffer``),
the policy client that drives the train workers, and the
asyncio controller that drives them (``controller``)."""
