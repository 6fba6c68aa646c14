"""`SGLangEngine`'s control and info routes: weights, pause/continue, flush, abort, health.

Why a module of its own: these are the admin half of the protocol (every call carries
`admin_api_key`) with their own state — the pause flag, its lease, the KV namespace a pause
moves to, the aborts to re-send after a resume — while `client.py` keeps generation. The mixin
reads and writes the attributes `SGLangEngine.__init__` sets; it is not used on its own.

- Weight paths are sent absolute (SGLang resolves relative ones in its own cwd).
- Every `pause()` moves the client to a fresh `kv_namespace` first, so a request sent after a
  pause never reuses prefix KV computed before it, i.e. by older weights.
- Info routes are the 0.5.23 names (`/model_info`, `/server_info`) with a fallback to the
  deprecated `get_` forms on a 404.
- While this client has the engine paused, `is_healthy()` asks `/model_info`: SGLang's
  `/health_generate` waits behind the pause and answers 503 after 20 s.
- A `resume()` that did not get through (an error other than the engine being gone, a
  timeout or a cancel) leaves `paused` True, as the engine may still be paused (SGLang's pause
  has no lease), and `resume_wanted` True: `retry_resume()` sends it again (a pool's probe
  does, engines/pool_membership.py); a `pause()` since makes it do nothing.
- Colocated mode: while this client has the engine's memory released, `is_healthy()` is False
  without asking (it can neither serve nor load weights until resumed, so a pool's rejoin
  must wait for the resume); from the resume until a weight load it asks `/model_info` (the
  local engine refuses generation then, `/health_generate` included), so that an engine a
  pool marked down while it was released rejoins once resumed: the rejoin loads the weights.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import trio

from plumbing.errors import EngineError

from .http import EngineHTTP, EngineTimeouts
from .types import EngineUnavailableError, ModelInfo, PauseMode, check_version

logger = logging.getLogger("engines.client")  # the client's one logger name, as before the split


class ControlRoutesMixin:
    """The control and info routes of `SGLangEngine` (uses the state its `__init__` sets)."""

    _http: EngineHTTP
    _url: str
    timeouts: EngineTimeouts
    paused: bool
    resume_wanted: bool
    paused_elsewhere: bool
    pauses_elsewhere: int
    pause_lease_s: float | None
    kv_namespace: str
    _lease_lock: trio.Lock
    _kv_id: str
    _pauses: int
    _info_paths: dict[str, str]
    _aborts_in_pause: list[str]
    resting: str | None

    async def update_weights_from_disk(
        self,
        path: str | os.PathLike[str],
        weight_version: str | None = None,
        *,
        abort_all_requests: bool = False,
        flush_cache: bool = True,
    ) -> str:
        """Load weights from `path` (HF layout, sent absolute); returns the server's message.

        SGLang 0.5.23 refuses `flush_cache=True` (400, version not set) while requests are
        running (pause "in_place"); it accepts it while paused with only waiting (retracted)
        requests (pause "retract"), and when idle.

        Raises:
            EngineError: the server refused (it then keeps its old weights); the message is
                the server's.
        """
        body: dict[str, Any] = {
            "model_path": os.path.abspath(path),
            "abort_all_requests": abort_all_requests,
            "flush_cache": flush_cache,
        }
        if weight_version is not None:
            body["weight_version"] = weight_version
        result = await self._http.json(
            "POST",
            "/update_weights_from_disk",
            body=body,
            timeout=self.timeouts.weight_update_s,
            admin=True,
        )
        if isinstance(result, Mapping) and result.get("success") is False:
            raise EngineError(
                f"update_weights_from_disk failed: {result.get('message')}",
                url=self._url,
                body=str(result),
            )
        self.resting = None  # weights in: it serves again
        return str(result.get("message", "")) if isinstance(result, Mapping) else ""

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool = True
                                    ) -> None:  # fmt: skip
        body = {"new_version": new_version, "abort_all_requests": abort_all_requests}
        await self._http.json("POST", "/update_weight_version", body=body, admin=True)

    async def pause(self, mode: PauseMode = "abort") -> None:
        """`/pause_generation`: new requests wait until `resume()`; see SGLang for the modes.

        Requests sent from now on use a fresh `kv_namespace` (their `extra_key`): the weights
        may change before they run, and none may reuse KV computed before the pause."""
        self.paused = True  # before the call: it may reach the server even if it fails
        self.resume_wanted = False  # a retry of an earlier resume must not end this pause
        self._pauses += 1
        self.kv_namespace = f"rollouts-{self._kv_id}-{self._pauses}"
        body: dict[str, Any] = {"mode": mode}
        if self.pause_lease_s is not None:  # ends by itself unless renewed; SGLang ignores it
            body["lease_s"] = self.pause_lease_s
        try:
            # a renewal (`renew_pause`) waits until this pause got there: sent before it, it
            # paused "in_place" and the engine took this pause for a renewal (no abort)
            async with self._lease_lock:
                await self._http.json("POST", "/pause_generation", body=body, admin=True)
        except EngineUnavailableError:
            self.paused = False  # not reached, or the server is gone: nothing is paused
            raise

    def mark_paused_elsewhere(self, paused: bool) -> None:
        """Another process has the engine paused (a rollout worker's client: the trainer, for a
        weight push), or no longer: requests wait behind that pause by design, so the stall watch
        (engines/stall.py) does not count the time. Set by this client's owner, who is told."""
        if paused and not self.paused_elsewhere:
            self.pauses_elsewhere += 1
        self.paused_elsewhere = paused

    async def renew_pause(self) -> None:
        """Renew the lease of this client's pause: the same pause again, "in_place" so that
        SGLang (which has no lease) aborts nothing held behind it."""
        body = {"mode": "in_place", "lease_s": self.pause_lease_s}
        async with self._lease_lock:  # a renewal arriving after the resume would pause again
            if self.paused:
                await self._http.json("POST", "/pause_generation", body=body, admin=True)

    async def resume(self) -> None:
        """`/continue_generation`, then the aborts sent during the pause, once more: SGLang
        0.5.23 drops an abort of a request held behind a pause, which then runs. Until it gets
        through, `resume_wanted` stays True (see `retry_resume`)."""
        self.resume_wanted = True
        await self._resume(retry=False)

    async def retry_resume(self) -> None:
        """`resume()` again if the last one did not get through (an error, a timeout): the
        engine may still be paused, serving nothing, and a pool does not probe an engine this
        client has paused. Nothing if it got through or this client paused the engine since."""
        await self._resume(retry=True)

    async def _resume(self, *, retry: bool) -> None:
        try:
            async with self._lease_lock:
                if retry and not (self.paused and self.resume_wanted):
                    return
                pauses = self._pauses
                await self._http.json("POST", "/continue_generation", body={}, admin=True)
                if self._pauses != pauses:  # a pause since holds the engine now, and its
                    return  # resume re-sends the aborts
                self.paused = self.resume_wanted = False
        except EngineUnavailableError:
            self.paused = self.resume_wanted = False  # gone: a restarted server is not paused
            self._aborts_in_pause.clear()
            raise
        pending, self._aborts_in_pause = self._aborts_in_pause, []
        for rid in dict.fromkeys(pending):
            body = {"rid": rid} if rid else {"abort_all": True}
            try:
                await self._http.request("POST", "/abort_request", body=body, admin=True,
                                         timeout=self.timeouts.control_s, retries=0)  # fmt: skip
            except EngineError as exc:  # the request may be gone anyway; never fail a resume
                logger.warning("%s: re-sending abort %r after the resume failed: %s",
                               self._url, body, exc)  # fmt: skip

    async def flush_cache(self) -> None:
        """`/flush_cache`; SGLang 0.5.23 refuses (400) while requests are running, or queued
        outside a pause (`is_fully_idle(ignore_waiting=paused)`)."""
        await self._http.request(
            "POST", "/flush_cache", timeout=self.timeouts.control_s, admin=True
        )

    async def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """`/release_memory_occupation` (colocated mode): the engine frees the memory of `tags`
        ("weights", "kv_cache"; default all). It must be idle (400 otherwise); SGLang needs
        `--enable-memory-saver`. Not retried: the caller decides (training/loops/colocate.py)."""
        body = {} if tags is None else {"tags": list(tags)}
        await self._http.json("POST", "/release_memory_occupation", body=body, admin=True,
                              timeout=self.timeouts.control_s, retries=0)  # fmt: skip
        self.resting = "released"

    async def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """`/resume_memory_occupation`: the memory is taken again; released weights hold
        nothing until the next weight load."""
        body = {} if tags is None else {"tags": list(tags)}
        await self._http.json("POST", "/resume_memory_occupation", body=body, admin=True,
                              timeout=self.timeouts.control_s, retries=0)  # fmt: skip
        self.resting = "resumed"  # until weights are loaded

    async def abort(self, rid: str) -> None:
        """Abort one request; it returns with `finish_reason.type == "abort"`. Unknown rids are
        ignored. SGLang aborts every rid that starts with `rid`: use rids that are never
        prefixes of each other. While this client has the engine paused, the abort is sent
        again after `resume()` (SGLang loses aborts of requests held behind a pause)."""
        if self.paused:
            self._aborts_in_pause.append(rid)
        await self._http.request(
            "POST",
            "/abort_request",
            body={"rid": rid},
            timeout=self.timeouts.control_s,
            admin=True,
        )

    async def abort_all(self) -> None:
        """Abort every request on the engine; one attempt: an engine that cannot be reached
        (often one being stopped at the same shutdown) has nothing left to abort."""
        body = {"abort_all": True}
        if self.paused:
            self._aborts_in_pause.append("")
        timeout = self.timeouts.control_s
        await self._http.request("POST", "/abort_request", body=body, timeout=timeout, admin=True,
                                 retries=0)  # fmt: skip

    async def _info(self, name: str) -> Any:
        """GET `/{name}` (0.5.23), falling back to the deprecated `/get_{name}` on a 404."""
        path = self._info_paths.get(name, f"/{name}")
        try:
            return await self._http.json("GET", path)
        except EngineError as exc:
            if exc.status != 404 or path != f"/{name}":
                raise
        self._info_paths[name] = f"/get_{name}"
        return await self._http.json("GET", f"/get_{name}")

    async def model_info(self) -> ModelInfo:
        info = await self._info("model_info")
        if not isinstance(info, Mapping):
            raise EngineError("GET /model_info: expected an object", url=self._url, body=str(info))
        version = info.get("weight_version")
        return ModelInfo(
            model_path=str(info.get("model_path", "")),
            weight_version=None if version is None else str(version),
            raw=dict(info),
        )

    async def server_info(self) -> dict[str, Any]:
        info = await self._info("server_info")
        if not isinstance(info, Mapping):
            raise EngineError("GET /server_info: expected an object", url=self._url, body=str(info))
        return dict(info)

    async def check_server(self) -> str:
        """Read `/server_info` and refuse servers older than `MIN_SGLANG_VERSION`.

        Returns:
            The server's version string.

        Raises:
            EngineError: the version is missing, unreadable or too old (the message says why
                and what to install).
        """
        return check_version(await self.server_info(), self._url)

    async def is_healthy(self) -> bool:
        """One probe, no retries: True on 200.

        `/health_generate` normally; `/model_info` while this client has the engine paused, or
        was told another process has (`mark_paused_elsewhere`: a rollout worker's client while
        the trainer pushes), since SGLang's generation probe waits behind the pause and answers
        503 after 20 s, and from a memory resume until weights are loaded; False while this
        client has its memory released (the module docstring).
        """
        if self.resting == "released":
            return False
        try:
            if self.paused or self.paused_elsewhere or self.resting == "resumed":
                await self._http.request(
                    "GET", "/model_info", timeout=self.timeouts.health_s, retries=0
                )
            else:
                await self._http.request(
                    "GET", "/health_generate", timeout=self.timeouts.health_s, retries=0
                )
        except EngineError:
            return False
        return True

    async def wait_healthy(self, timeout_s: float = 600.0, *, poll_interval_s: float = 1.0) -> None:
        """Poll `/health_generate` until it answers 200.

        Raises:
            EngineUnavailableError: not healthy within `timeout_s` (names the last failure).
        """
        await self._http.wait_ok("/health_generate", timeout_s, poll_interval_s)
