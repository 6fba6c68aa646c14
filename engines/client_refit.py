"""`SGLangEngine`'s distributed refit routes: a process group with the trainer, tensors by
broadcast instead of through a shared filesystem.

Why a module of its own: the five routes (SGLang 0.5.23's `init_weights_update_group`,
`begin_weight_update`, `update_weights_from_distributed`, `end_weight_update`,
`destroy_weights_update_group`) are one protocol with its own rules, used only by
`engines/refit.py`; the disk path stays in `client_control.py`. The mixin reads the attributes
`SGLangEngine.__init__` sets.

- None is retried: each call takes part in a collective (a rendezvous, a broadcast) that a
  repeated request would join twice. A refusal (`success: false`, 400) raises `EngineError`
  with the server's message.
- The update call returns once the engine has received and loaded its tensors, so it runs
  while the trainer broadcasts (engines/refit.py), under the caller's deadline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from plumbing.errors import EngineError

from .http import EngineHTTP, EngineTimeouts


class RefitRoutesMixin:
    """The distributed refit routes of `SGLangEngine` (uses the state its `__init__` sets)."""

    _http: EngineHTTP
    _url: str
    timeouts: EngineTimeouts
    resting: str | None

    async def _refit_call(self, path: str, body: dict[str, Any], timeout: float) -> str:
        # a 400 (refused) raises EngineError with the server's body; an engine that cannot be
        # reached, EngineUnavailableError (the sender leaves it out of the group)
        result = await self._http.json("POST", path, body=body, timeout=timeout, admin=True,
                                       retries=0)  # fmt: skip
        if isinstance(result, Mapping) and result.get("success") is False:
            raise EngineError(f"{path.lstrip('/')} failed: {result.get('message')}",
                              url=self._url, body=str(result))  # fmt: skip
        if path in ("/update_weights_from_distributed", "/end_weight_update"):
            self.resting = None  # weights in (a colocated engine's resume awaited them)
        return str(result.get("message", "")) if isinstance(result, Mapping) else ""

    async def init_weights_update_group(self, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str, *,
                                        backend: str = "gloo", timeout_s: float) -> str:  # fmt: skip
        """Join the trainer's group as rank `rank_offset`; returns once every rank joined."""
        body = {"master_address": master_address, "master_port": master_port,
                "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
                "backend": backend}  # fmt: skip
        return await self._refit_call("/init_weights_update_group", body, timeout_s)

    async def destroy_weights_update_group(self, group_name: str) -> str:
        return await self._refit_call("/destroy_weights_update_group", {"group_name": group_name},
                                      self.timeouts.control_s)  # fmt: skip

    async def begin_weight_update(self) -> str:
        return await self._refit_call("/begin_weight_update", {}, self.timeouts.control_s)

    async def end_weight_update(self) -> str:
        # the weight update's own deadline: the local engine loads the staged buckets here
        return await self._refit_call("/end_weight_update", {}, self.timeouts.weight_update_s)

    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        *,
        weight_version: str | None = None,
        flush_cache: bool = False,
        load_format: str | None = "flattened_bucket",
        timeout_s: float,
    ) -> str:
        """Receive one bucket the trainer broadcasts on `group_name` and load it; with
        `weight_version` (the last bucket) the engine labels its weights with it."""
        body: dict[str, Any] = {"names": list(names), "dtypes": list(dtypes),
                                "shapes": [list(s) for s in shapes], "group_name": group_name,
                                "flush_cache": flush_cache, "abort_all_requests": False,
                                "load_format": load_format}  # fmt: skip
        if weight_version is not None:
            body["weight_version"] = weight_version
        return await self._refit_call("/update_weights_from_distributed", body, timeout_s)
