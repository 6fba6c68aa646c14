"""Futures and ordering, as the `tinker` SDK expects them.

Every mutating request is answered at once with a `request_id`; the SDK then polls
`/api/v1/retrieve_future` until the result is there. `FutureTable` holds the results (bounded:
the oldest finished entries go first) and answers a poll by waiting up to `poll_wait_s` for
the result, then `try_again` (so the SDK, which re-polls at once, does not spin).

`ModelQueue` runs one model's requests in the order of their `seq_id` (the SDK numbers each
training client's requests 1, 2, ...; chunks of one `forward_backward` may arrive out of
order): a request waits until every smaller seq_id has been started, and requests run one at
a time. A gap that is not filled within `gap_timeout_s` fails the requests behind it, naming
the missing seq_id, instead of leaving the client polling forever.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from rollouts.tinker_server.wire import TinkerRequestError

log = logging.getLogger("rollouts.tinker")
Job = Callable[[], Awaitable[Any]]


@dataclass
class Entry:
    done: trio.Event = field(default_factory=trio.Event)
    result: Any = None  # a JSON-able dict, or protobuf bytes
    error: TinkerRequestError | None = None


class FutureTable:
    def __init__(self, max_entries: int = 10_000, poll_wait_s: float = 20.0) -> None:
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.max_entries, self.poll_wait_s = max_entries, poll_wait_s

    def new(self) -> tuple[str, Entry]:
        request_id = uuid.uuid4().hex
        self.entries[request_id] = entry = Entry()
        while len(self.entries) > self.max_entries:
            oldest = next(iter(self.entries))
            if not self.entries[oldest].done.is_set():
                break
            del self.entries[oldest]
        return request_id, entry

    @staticmethod
    async def run(entry: Entry, job: Job) -> None:
        """Run `job` and record its result or error in `entry`."""
        try:
            entry.result = await job()
        except TinkerRequestError as exc:
            entry.error = exc
        except Exception as exc:  # a server-side failure: the SDK shows it, the server goes on
            log.exception("a tinker request failed")
            entry.error = TinkerRequestError(f"{type(exc).__name__}: {exc}", 500, "server")
        finally:
            entry.done.set()

    async def wait(self, request_id: str) -> Entry | None:
        """The finished entry, or None when it is still running after `poll_wait_s`."""
        entry = self.entries.get(request_id)
        if entry is None:
            raise TinkerRequestError(
                f"no request {request_id!r} on this server (never submitted here, or a "
                "restarted server: futures do not survive a restart)",
                status=404,
            )
        with trio.move_on_after(self.poll_wait_s):
            await entry.done.wait()
        return entry if entry.done.is_set() else None


class ModelQueue:
    """One model's requests, run one at a time in seq_id order (see the module docstring)."""

    def __init__(self, nursery: trio.Nursery, table: FutureTable, name: str,
                 next_seq: int = 1, gap_timeout_s: float = 120.0) -> None:  # fmt: skip
        self.nursery, self.table, self.name = nursery, table, name
        self.next_seq, self.gap_timeout_s = next_seq, gap_timeout_s
        self.waiting: dict[int, tuple[Entry, Job]] = {}
        self.early = 0  # requests that arrived before a smaller seq_id (and waited for it)
        self.send, self.receive = trio.open_memory_channel[tuple[Entry, Job]](float("inf"))
        nursery.start_soon(self._worker)

    def submit(self, seq_id: int, job: Job) -> str:
        """Queue `job` as request `seq_id`; returns its request id at once."""
        request_id, entry = self.table.new()
        if seq_id < self.next_seq or seq_id in self.waiting:
            entry.error = TinkerRequestError(
                f"{self.name}: seq_id {seq_id} was already used (next expected: "
                f"{self.next_seq}); each request of a training client needs a new seq_id"
            )
            entry.done.set()
            return request_id
        self.waiting[seq_id] = (entry, job)
        self.early += seq_id != self.next_seq
        self._release()
        if self.waiting:
            self.nursery.start_soon(self._expire_gap, self.next_seq)
        return request_id

    def _release(self) -> None:
        while self.next_seq in self.waiting:
            self.send.send_nowait(self.waiting.pop(self.next_seq))
            self.next_seq += 1

    async def _expire_gap(self, missing: int) -> None:
        await trio.sleep(self.gap_timeout_s)
        if self.next_seq != missing or not self.waiting:
            return
        for seq in sorted(self.waiting):
            entry, _ = self.waiting.pop(seq)
            entry.error = TinkerRequestError(
                f"{self.name}: request seq_id {seq} waited {self.gap_timeout_s:.0f} s for "
                f"seq_id {missing}, which never arrived; recreate the training client"
            )
            entry.done.set()
        self.next_seq = max(self.next_seq, seq + 1)

    async def _worker(self) -> None:
        async for entry, job in self.receive:
            await FutureTable.run(entry, job)
