"""Several choices for one prompt (OpenAI's `n`), merged into one stream of (index, item).

Choice 0 runs first; the others start once it has produced its first token. By then its
prompt is computed and its full blocks are in the engine's prefix cache, so the other choices
reuse them instead of each computing the same prompt in the same step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TypeAlias

from prefixrag.engine.outputs import GenerationDelta, GenerationResult

Item: TypeAlias = GenerationDelta | GenerationResult
# what a pump hands over: an item, the error that ended its stream, or None at its end
_Message: TypeAlias = tuple[int, Item | Exception | None]


async def fan_out(streams: list[AsyncIterator[Item]]) -> AsyncIterator[tuple[int, Item]]:
    """Every item of every stream tagged with its stream's index, as they come. Closing this
    (or an error in any stream) closes every stream, which aborts their requests."""
    queue: asyncio.Queue[_Message] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(0, streams[0], queue))]
    num_open = len(streams)
    try:
        while num_open:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if len(tasks) < len(streams):  # choice 0 has its first token: its prompt is cached
                tasks += [
                    asyncio.ensure_future(_pump(i, s, queue)) for i, s in enumerate(streams[1:], 1)
                ]
            if item is None:
                num_open -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()  # a cancelled pump closes its stream
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams[len(tasks) :]:  # never started: nothing was queued for them
            await stream.aclose()  # type: ignore[attr-defined]


async def collect_choices(streams: list[AsyncIterator[Item]]) -> list[GenerationResult]:
    """Run every choice to its end; their results in index order."""
    results: dict[int, GenerationResult] = {}
    async for index, item in fan_out(streams):
        if isinstance(item, GenerationResult):
            results[index] = item
    if len(results) != len(streams):
        raise RuntimeError("a generation ended without a result")
    return [results[i] for i in range(len(streams))]


async def _pump(index: int, stream: AsyncIterator[Item], queue: asyncio.Queue[_Message]) -> None:
    try:
        async for item in stream:
            queue.put_nowait((index, item))
    except Exception as exc:
        queue.put_nowait((index, exc))
        return
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    queue.put_nowait((index, None))
