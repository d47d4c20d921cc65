"""One way to call workers, whether they are Ray actors or objects in this process.

``spawn(cls, ..., backend="ray")`` starts ``cls`` as a Ray actor; ``backend="local"`` builds it
here and runs each call in a worker thread, one call at a time per actor (as a Ray actor does),
so that the asyncio controller stays responsive and generation overlaps training either way.
The same controller code drives both: the local backend serves unit tests and machines without
Ray (the GPU benchmark machine).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

Backend = Literal["ray", "local"]


class LocalActor:
    """An object of this process behind the actor interface.

    ``in_process``: its calls can take Python callables (e.g. a callback run on its thread);
    a Ray actor's cannot, and streams a generator method's items instead (``stream``).
    """

    in_process = True

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self._obj = cls(*args, **kwargs)
        # one thread of its own: calls run one at a time, and a hung call does not hold up
        # asyncio.run's shutdown of the default executor
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=cls.__name__)

    @property
    def obj(self) -> Any:
        """The object itself (in this process: another local actor's call may take it)."""
        return self._obj

    def _call(self, method: str, args, kwargs):
        return getattr(self._obj, method)(*args, **kwargs)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await self.submit(method, *args, **kwargs)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> asyncio.Future:
        """Queue the call now (ahead of any call made after this one) and return an awaitable."""
        return asyncio.get_running_loop().run_in_executor(self._executor, self._call, method, args, kwargs)

    def kill(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        close = getattr(self._obj, "close", None)
        if close is not None:
            close()


class RayActor:
    """A Ray actor behind the same interface; ``call`` awaits the ObjectRef.

    ``ray_options`` go to ``.options`` (resources, scheduling); ``remote_options`` to
    ``ray.remote`` (what ``.options`` does not take, e.g. ``concurrency_groups``).
    """

    in_process = False

    def __init__(
        self, cls: type, *args: Any, ray_options: dict | None = None, remote_options: dict | None = None, **kwargs: Any
    ) -> None:
        import ray

        remote = ray.remote(**remote_options)(cls) if remote_options else ray.remote(cls)
        self._handle = remote.options(**(ray_options or {})).remote(*args, **kwargs)
        self._killed = False

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await self.submit(method, *args, **kwargs)

    def submit(self, method: str, *args: Any, **kwargs: Any):
        """Queue the call now (an actor runs one caller's calls in order) and return its awaitable ref."""
        return getattr(self._handle, method).remote(*args, **kwargs)

    def stream(self, method: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Call a generator method as a Ray streaming call and yield its items as the actor
        yields them (the call still runs while the first items arrive). The generator's error
        is raised here, after the items yielded before it."""
        return _items(getattr(self._handle, method).options(num_returns="streaming").remote(*args, **kwargs))

    def submit_in(self, group: str, method: str, *args: Any, **kwargs: Any):
        """Queue the call in the actor's concurrency ``group`` (given in ``remote_options``): it
        runs beside the calls of the other groups."""
        return getattr(self._handle, method).options(concurrency_group=group).remote(*args, **kwargs)

    def kill(self) -> None:
        import ray

        if self._killed:  # an actor shared by two parts is killed once
            return
        self._killed = True
        try:
            ray.get(self._handle.close.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - the actor may not have a close(), or be gone already
            pass
        ray.kill(self._handle)


async def _items(refs) -> AsyncIterator[Any]:
    """The objects of a Ray streaming call's refs (an ``ObjectRefGenerator``), as they come."""
    async for ref in refs:
        yield await ref


class ActorPart:
    """One part of a Ray actor that hosts several objects (a
    :class:`~splitrl.controller.placement.ColocatedWorker`: ``train`` and ``gen``) behind the same
    interface. The part's calls run in the actor's concurrency group of the same name (one
    thread, one call at a time), so the other part's calls run meanwhile.
    """

    in_process = False

    def __init__(self, actor: RayActor, part: str) -> None:
        self.actor = actor
        self.part = part

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await self.submit(method, *args, **kwargs)

    def submit(self, method: str, *args: Any, **kwargs: Any):
        """Queue ``method`` of this part and return its awaitable ref."""
        return self.actor._handle.call.options(concurrency_group=self.part).remote(self.part, method, args, kwargs)

    def stream(self, method: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """:meth:`RayActor.stream` for a generator method of this part."""
        return _items(
            self.actor._handle.call_stream.options(concurrency_group=self.part, num_returns="streaming").remote(
                self.part, method, args, kwargs
            )
        )

    def submit_host(self, method: str, *args: Any, **kwargs: Any):
        """Queue ``method`` of the hosting object itself, in this part's group."""
        return getattr(self.actor._handle, method).options(concurrency_group=self.part).remote(*args, **kwargs)

    def kill(self) -> None:
        self.actor.kill()


def spawn(
    cls: type,
    *args: Any,
    backend: Backend,
    ray_options: dict | None = None,
    remote_options: dict | None = None,
    **kwargs: Any,
):
    """Start ``cls(*args, **kwargs)`` as an actor of ``backend`` (the options apply to Ray only)."""
    if backend == "ray":
        return RayActor(cls, *args, ray_options=ray_options, remote_options=remote_options, **kwargs)
    return LocalActor(cls, *args, **kwargs)
