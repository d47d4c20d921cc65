"""The single controller and its parts (DESIGN §4): replay buffer and sampler (``buffer``),
group advantages (``advantages``), generation and train actors, the policy client and the
asyncio controller that drives them (``controller``)."""
