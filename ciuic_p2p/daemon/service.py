"""The daemon's life as a service: start the parts, join, report ready, reload on
SIGHUP, stop cleanly on SIGTERM/Ctrl+C.

- Ready (``READY=1`` under systemd) once the node listens and its first join attempt
  has ended: joined, or ``node.first_join_timeout_s`` spent. A node whose seeds are
  down at boot is not a failed service (systemd would restart it in a loop): it keeps
  trying every ``node.join_retry_s`` in the background and says so in its status.
  Only a refusal (our credential is not accepted) ends it with exit status 1.
- SIGHUP re-reads the config file and environment: the log settings, the join seeds
  and the revocation list take effect at once; a changed key that needs a restart is
  named in a warning and in the status.
- SIGTERM or Ctrl+C: announce the leave, let the trainers' sessions and the store
  close, flush the audit log, close every link with a reason, all within
  ``node.stop_timeout_s``; a second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ciuic_p2p.admission import Trust, load_crl
from ciuic_p2p.config import Config
from ciuic_p2p.daemon.assembly import NodeAssembly
from ciuic_p2p.daemon.auditlog import AuditLog
from ciuic_p2p.daemon.sdnotify import Notifier
from ciuic_p2p.errors import CiuicError
from ciuic_p2p.logsetup import announce, configure_logging, get_logger
from ciuic_p2p.transport.errors import RefusedError, TransportError

log = get_logger("ciuic.service")

RELOADABLE = {"log", "node.join", "node.first_join_timeout_s", "node.join_retry_s",
              "node.stop_timeout_s"}  # fmt: skip
"""Settings a SIGHUP applies to the running node; any other change needs a restart."""


class JoinRefused(CiuicError):
    """A seed refused our credential: retrying cannot help."""


class NodeService:
    def __init__(
        self,
        config: Config,
        parts: NodeAssembly,
        *,
        reload_config: Callable[[], Config],
        crl_path: Path | None,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.parts = parts
        self.reload_config = reload_config
        self.crl_path = crl_path
        self.notifier = notifier or Notifier()
        self.state = "starting"
        self.join_error = ""
        self.join_attempts = 0
        self.needs_restart: list[str] = []
        self.reloads = 0
        # `ciuic-node leave` on the control socket stops the service too.
        self._stop = parts.control.leave_requested if parts.control else asyncio.Event()
        self._signals = 0
        self._join_task: asyncio.Task[None] | None = None
        self._flag_seeds: list[str] = []
        self._exit_code = 0
        if parts.control is not None:  # `reload` and `runs` on the control socket
            parts.control.service, parts.control.trainers = self, parts.trainers

    def status(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "join_error": self.join_error,
            "join_attempts": self.join_attempts,
            "reloads": self.reloads,
            "needs_restart": self.needs_restart,
        }

    # -- running ------------------------------------------------------------------------------

    async def run(self, flag_seeds: list[str]) -> int:
        """Run until stopped; ``flag_seeds`` (``--join``) go before ``node.join``."""
        self._flag_seeds = flag_seeds
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_stop_signal, signal.SIGTERM)
        loop.add_signal_handler(signal.SIGINT, self._on_stop_signal, signal.SIGINT)
        loop.add_signal_handler(signal.SIGHUP, self._on_reload_signal)
        self.notifier.start_watchdog(loop)
        if self.parts.audit is not None:
            self._tick_audit(loop, self.parts.audit)
        code = 0
        try:
            if self._seeds():
                await self._first_join()
            self.state = "running" if self._joined() or not self._seeds() else "joining"
            self.notifier.ready(self._summary())
            log.info("ready", state=self.state, address=self.parts.daemon.address)
            await self._stop.wait()
            code = self._exit_code
        except JoinRefused as exc:
            log.error("join_refused", error=str(exc))
            code = 1
        await self.stop("refused" if code else "requested")
        return code

    def _tick_audit(self, loop: asyncio.AbstractEventLoop, audit: AuditLog) -> None:
        # Traffic is written once per interval even when no chunk arrives to do it.
        period_s = min(self.config.audit.interval_s, 5.0)

        def tick() -> None:
            if not self._stop.is_set():
                audit.tick()
                loop.call_later(period_s, tick)

        loop.call_later(period_s, tick)

    def _joined(self) -> bool:
        node = self.parts.daemon.node
        return node is not None and node.joined and len(node.view()) > 1

    def _summary(self) -> str:
        d = self.parts.daemon
        alive = len(d.mesh.view()) if d.node is not None else 0
        if self.state == "joining":
            return (
                f"joining (attempt {self.join_attempts}: {self.join_error}); "
                f"listening on {d.address}"
            )
        return f"{self.state}: {alive} members alive; listening on {d.address}"

    def _seeds(self) -> list[str]:
        # Read each round: a reload may have changed node.join.
        return self._flag_seeds + [s for s in self.config.node.join if s not in self._flag_seeds]

    async def _first_join(self) -> None:
        seeds = self._seeds()
        timeout_s = self.config.node.first_join_timeout_s
        try:
            await asyncio.wait_for(self._join_any(once=True), timeout_s)
        except TimeoutError:
            self.join_error = self.join_error or (
                f"no seed answered within {timeout_s:g} s ({', '.join(seeds)})"
            )
        if not self._joined():
            log.warning(
                "join_pending",
                seeds=seeds,
                error=self.join_error,
                retry_s=self.config.node.join_retry_s,
            )
            self._join_task = asyncio.get_running_loop().create_task(self._join_later())

    async def _join_later(self) -> None:
        try:
            await self._join_any()
        except JoinRefused as exc:  # as at the first attempt: retrying cannot help
            log.error("join_refused", error=str(exc))
            self._exit_code = 1
            self._stop.set()

    async def _join_any(self, once: bool = False) -> None:
        """Try each seed in turn until one lets us in (once: one round only)."""
        while not self._stop.is_set():
            for seed in self._seeds():
                self.join_attempts += 1
                try:
                    view = await self.parts.daemon.join(seed)
                except TransportError as exc:
                    if isinstance(exc, RefusedError):
                        raise JoinRefused(f"cannot join through {seed}: {exc}") from None
                    self.join_error = f"{seed}: {exc}"
                    continue
                except (TimeoutError, ValueError) as exc:
                    self.join_error = f"{seed}: {exc}"
                    continue
                self.join_error = ""
                announce(
                    log, "joined", f"joined through {seed}: {len(view)} members", seed=seed,
                    members=len(view),
                )  # fmt: skip
                if self.state == "joining":
                    self.state = "running"
                    self.notifier.status(self._summary())
                return
            if once:
                return
            self.notifier.status(self._summary())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.config.node.join_retry_s)

    # -- signals --------------------------------------------------------------------------------

    def _on_stop_signal(self, signum: int) -> None:
        self._signals += 1
        if self._signals > 1:
            # The second Ctrl+C: the user does not want to wait for a clean leave.
            log.warning("exiting_now", reason="second signal")
            os._exit(128 + signum)
        log.info("stop_requested", signal=signal.Signals(signum).name)
        self._stop.set()

    def _on_reload_signal(self) -> None:
        asyncio.get_running_loop().create_task(self.reload())

    async def reload(self) -> dict[str, Any]:
        """What SIGHUP does (and ``ciuic-node reload``); what it did: the reload count,
        the keys changed, those that need a restart, the revocation list, or the error
        that kept the old config."""
        self.notifier.reloading()
        try:
            new = self.reload_config()
        except CiuicError as exc:
            log.error("reload_failed", error=str(exc))
            self.notifier.ready(f"reload failed, old config kept: {exc}")
            return {"reloads": self.reloads, "error": str(exc)}
        changed = _changed_keys(self.config, new)
        self.needs_restart = sorted(k for k in changed if not _reloadable(k))
        if new.log != self.config.log:
            configure_logging(new.log)
        keep = self.config
        self.config = dataclasses.replace(
            keep, log=new.log, node=dataclasses.replace(
                keep.node, join=new.node.join,
                first_join_timeout_s=new.node.first_join_timeout_s,
                join_retry_s=new.node.join_retry_s, stop_timeout_s=new.node.stop_timeout_s,
            ),
        )  # fmt: skip
        crl_note = self._reload_crl()
        self.reloads += 1
        if self.needs_restart:
            log.warning("reload_needs_restart", keys=self.needs_restart)
        log.info("reloaded", changed=sorted(changed), revocation_list=crl_note)
        self.notifier.ready(self._summary())
        return {
            "reloads": self.reloads,
            "changed": sorted(changed),
            "needs_restart": self.needs_restart,
            "revocation_list": crl_note,
        }

    def _reload_crl(self) -> str:
        transport = self.parts.daemon.transport
        if self.crl_path is None or not self.crl_path.exists():
            return "none"
        try:
            trust = Trust(transport.trust.ca, load_crl(self.crl_path))
        except (CiuicError, ValueError, OSError) as exc:
            log.error("revocation_list_not_reloaded", path=str(self.crl_path), error=str(exc))
            return f"kept the old one: {exc}"
        for key in transport.set_trust(trust):  # links of revoked nodes close now
            self.parts.daemon.ban(key)
        self.parts.daemon.trust_changed()  # and what they signed no longer counts
        return str(self.crl_path)

    # -- stopping -------------------------------------------------------------------------------

    async def stop(self, why: str) -> None:
        self.state = "stopping"
        self.notifier.stopping(f"leaving the mesh ({why})")
        if self._join_task is not None:
            self._join_task.cancel()
        parts = self.parts
        if parts.trainers is not None:  # before leaving: the trainer's work comes first
            await parts.trainers.ask_checkpoint(self.config.store.stop_checkpoint_wait_s)
        timeout_s = self.config.node.stop_timeout_s
        try:
            await asyncio.wait_for(self._close_parts(), timeout_s)
        except TimeoutError:
            log.warning("stop_timeout", timeout_s=timeout_s)
            await parts.daemon.close()
        if parts.audit is not None:
            parts.audit.stopped(why)
            parts.audit.close()  # the pending traffic tally, then fsync
        if parts.control is not None:
            await parts.control.close()
        self.notifier.close()

    async def _close_parts(self) -> None:
        p = self.parts
        if p.trainers is not None:
            # What the trainer got is where the next start resumes: the chunks that
            # come from now on are repaired after a restart, not lost with this life.
            p.daemon.save_resume_point()
            await p.trainers.close()
        await p.store.close()
        await p.daemon.leave()  # announced, drained, links closed with a reason
        for close in reversed(p.closers):
            await close()


def _changed_keys(old: Config, new: Config) -> set[str]:
    out: set[str] = set()
    for section in dataclasses.fields(old):
        a, b = getattr(old, section.name), getattr(new, section.name)
        if not dataclasses.is_dataclass(a):
            if a != b:
                out.add(section.name)
            continue
        for f in dataclasses.fields(a):
            if getattr(a, f.name) != getattr(b, f.name):
                out.add(f"{section.name}.{f.name}")
    return out


def _reloadable(key: str) -> bool:
    return key in RELOADABLE or key.split(".", maxsplit=1)[0] in RELOADABLE
