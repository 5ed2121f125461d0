"""``install(accelerator, levels=[...])``: a bare ``save_state()`` saves the stock folder by level.

The training thread agrees on the step (one collective with several processes) and saves lazily into the
fastest due level's ``step-<n>`` folder; the finisher thread ends this process's part; on the main process,
the ``lazyckpt-accelerate-levels`` thread waits for the other processes' parts (bounded by ``load_timeout``);
then ``schedule.MultiLevel`` copies the complete folder to the slower levels. Several nodes: ``_nodes.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import weakref
from typing import TYPE_CHECKING, Any, Protocol

from accelerate.utils.constants import RNG_STATE_NAME

from lazyckpt.accelerate import _compat
from lazyckpt.accelerate._folder_save import SaveStateCall
from lazyckpt.accelerate._nodes import Nodes, staging_of
from lazyckpt.checkpointer import producer_of
from lazyckpt.cluster import SingleWriter, replicated_index
from lazyckpt.commit.folder import marker_is_stale, pending_markers
from lazyckpt.core.handle import Completion, SaveHandle, SaveStats, confirm
from lazyckpt.errors import IncompleteCheckpointError, SaveRefusedError
from lazyckpt.levels import Level, check_step
from lazyckpt.schedule import MultiLevel, check_levels, refuse_replicas, tensor_bytes
from lazyckpt.threads.workers import Worker

if TYPE_CHECKING:
    from lazyckpt import LazyCheckpointer

logger = logging.getLogger("lazyckpt.accelerate")


class HandleOwner(Protocol):
    """What the levels need of their ``AccelerateHandle``."""

    load_timeout: float

    def training_since_last_save(self) -> bool: ...

    def save_into(
        self, output_dir: Any, safe_serialization: bool, kwargs: dict[str, Any], *, prepare: Any = ...
    ) -> tuple[Any, SaveStateCall]: ...


def refuse_automatic_naming(accelerator: Any) -> None:
    """Raise ``SaveRefusedError`` with automatic checkpoint naming, which levels replace."""
    pc = accelerator.project_configuration
    if pc.automatic_checkpoint_naming:
        raise SaveRefusedError(
            "lazyckpt.accelerate: levels replace ProjectConfiguration(automatic_checkpoint_naming=True"
            f"{', total_limit=' + str(pc.total_limit) if pc.total_limit is not None else ''}): folders are named "
            "<level>/step-<n> and Level(keep=N) keeps N per level. Set automatic_checkpoint_naming=False."
        )


class StepCounter:
    """The step a bare ``save_state()`` saves under: the base last set plus the real steps of the first
    prepared optimizer since then (``AccelerateHandle.step``). Without a prepared optimizer: the base."""

    def __init__(self, accelerator: Any) -> None:
        _compat.count_real_steps()
        self._accelerator = accelerator
        self._base = 0
        self._opt: weakref.ref[Any] | None = None
        self._offset = 0  # the optimizer's real steps when the base was set
        self._sync(_compat.first_optimizer(accelerator), reset=True)

    def get(self) -> int:
        opt = _compat.first_optimizer(self._accelerator)
        if opt is None:
            return self._base
        self._sync(opt, reset=False)
        return self._base + _compat.real_steps(opt) - self._offset

    def set(self, step: int) -> None:
        self._base = check_step(step)
        self._sync(_compat.first_optimizer(self._accelerator), reset=True)

    def _sync(self, opt: Any, reset: bool) -> None:
        if opt is None:
            self._opt, self._offset = None, 0
        elif reset or self._opt is None or self._opt() is not opt:
            # a newly prepared optimizer counts from 0: its steps all came after install()
            self._offset = _compat.real_steps(opt) if reset else 0
            self._opt = weakref.ref(opt)


class LevelSaves:
    """One handle's saves by level: the ``MultiLevel`` (main process), the step counter, the pending
    level handles, and the thread that waits for other processes' parts (several processes)."""

    def __init__(self, owner: HandleOwner, accelerator: Any, checkpointer: LazyCheckpointer, levels: Any) -> None:
        levels = tuple(levels)
        check_levels(levels)
        refuse_automatic_naming(accelerator)
        self.owner = owner
        self.accelerator = accelerator
        self.checkpointer = checkpointer
        self.levels: tuple[Level, ...] = levels
        self.counter = StepCounter(accelerator)
        self.main = bool(accelerator.is_main_process)
        self.processes = int(accelerator.num_processes)
        self.last: SaveHandle | None = None  # the last bare save_state's handle
        opts = checkpointer.options
        self.producer = producer_of(checkpointer)
        # collective (every process installs): who shares each level's folder
        rank = int(accelerator.process_index)
        several = self.processes > 1 and Nodes.available()  # MPI has no c10d store: shared folders only
        self.nodes = Nodes(levels, rank, self.processes, owner.load_timeout) if several else None
        if self.nodes is None:
            refuse_replicas(levels, "Accelerate's save_state in one process (or without a c10d store)")
        replicated = replicated_index(levels)
        self._multi = (
            MultiLevel(checkpointer, levels, opts, folder=True, reuse=self.producer.reuse, replicate=True)
            if self.main
            else None
        )  # with replicas: the main process's MultiLevel sends its folders, the others hold copies
        self._holder = None if self.main or replicated is None else SingleWriter(levels, replicated, opts.fsync)
        self._pending: dict[int, SaveHandle] = {}  # step -> a level save not yet done
        self._sources: dict[str, SaveHandle] = {}  # folder under the main process's marker -> its handle
        self._others: Worker[tuple[SaveStateCall, Completion, _Gather | None]] = Worker(
            "lazyckpt-accelerate-levels", self._wait_for_others, lazy=True
        )

    # -- the training thread -------------------------------------------------------------------------
    def save(self, safe_serialization: bool, kwargs: dict[str, Any]) -> str | None:
        """A bare ``save_state()`` (training thread; collective with several processes): the step's folder to
        every level due at it. Returns the fastest due level's folder, or None when none is due."""
        refuse_automatic_naming(self.accelerator)
        training = self.owner.training_since_last_save()
        step = self.counter.get()
        held: str | None = None  # the main process's marker in the step's folder (several processes)
        if self.main:
            self._clear_fastest(step)
            held = self._claim(step)
        try:
            if self.processes > 1:
                step = self._agree(step)
            due = [i for i, lv in enumerate(self.levels) if lv.due(step)]
            if due and self.processes > 1 and self.levels[due[0]].is_url:
                raise SaveRefusedError(
                    f"lazyckpt.accelerate: with {self.processes} processes the fastest level due at step {step} "
                    f"must be a local folder (every process writes into it), not {self.levels[due[0]].path}"
                )
            gather = self._gather(due[0]) if due and self.nodes is not None else None
        except SaveRefusedError:  # raised on every process alike: nobody writes into the folder
            if held is not None:
                Nodes.release(held)
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(held))
            raise

        def produce(path: str) -> SaveHandle:
            # the marker stays if the save fails; made here (after the collective) when ``_claim`` could not
            marker = held if held is not None or gather is None or not gather.outside else Nodes.hold(path)
            source = self._produce(path, safe_serialization, kwargs, gather=gather and gather.held(marker))
            if marker is not None:
                self._sources[_compat.real_path(path)] = source  # for settle_folder
            return source

        handle: SaveHandle
        if self._multi is not None:
            handle = self._multi.save_with(step, produce, nbytes=self._nbytes)
        elif due and gather is not None and self.nodes is not None and gather.posts:
            # another node: its RNG file goes to the main process through the store (``_nodes.py``)
            folder = self.levels[due[0]].folder(step)
            staging = staging_of(folder)
            try:
                handle = self._produce(staging, safe_serialization, kwargs, gather=gather, label=folder)
            except BaseException as exc:  # tell the main process now, not at its timeout
                self.nodes.post(gather.seq, staging, exc)
                raise
        elif due:  # another process: its files into the same folder
            handle = self._produce(self.levels[due[0]].folder(step), safe_serialization, kwargs)
        else:
            return None
        self.last = handle
        if not due:
            return None
        self._pending = {s: h for s, h in self._pending.items() if not h.done()}
        self._sources = {f: h for f, h in self._sources.items() if not h.done()}
        self._pending[step] = handle
        if not training and self.processes == 1:
            handle.exception(timeout=None)  # nothing to overlap with: durable on return, as stock
        return handle.path

    def _nbytes(self) -> int:
        """The checkpoint's size: the prepared models' and optimizers' tensors."""
        return tensor_bytes(_compat.state_of(self.accelerator))

    def _clear_fastest(self, step: int) -> None:
        """Before ``step`` is saved again: wait for its earlier save and move the fastest level's old folder
        away, so no copy reads a folder being rewritten and no stale file stays."""
        earlier = self._pending.get(step)
        if earlier is not None:
            earlier.exception(timeout=None)  # errors stay the checkpointer's to report
        due = [lv for lv in self.levels if lv.due(step)]
        if not due or due[0].is_url:
            return
        folder = due[0].folder(step)
        if os.path.isdir(folder):
            try:
                self.checkpointer.remove(folder)  # renamed away now, deleted in the background
            except OSError as exc:
                logger.warning("lazyckpt.accelerate: could not move the old %s away: %s", folder, exc)

    def settle_folder(self, folder: str, timeout: float) -> None:
        """Before ``load_state(folder)``: wait at most ``timeout`` s for the main process's save of ``folder``
        (its marker there) to end; ``_load`` does not wait for this process's own markers."""
        source = self._sources.get(folder)
        if source is not None:
            try:
                source.exception(timeout=timeout)  # its error stays the checkpointer's to report
            except TimeoutError:
                pass

    def _claim(self, step: int) -> str | None:
        """Main process, several processes, before they agree on ``step``: claim ``step`` in the retention
        (``MultiLevel.claim``) and mark the fastest due level's folder incomplete until it is whole
        (``_gathered``), since other processes may write into it first. Returns the marker's path, or None
        (one process, no c10d store, a URL). Never raises (the others would wait in the collective)."""
        if self._multi is None or self.processes == 1:
            return None
        self._multi.claim(step)
        due = [lv for lv in self.levels if lv.due(step)]
        if not due or due[0].is_url or self.nodes is None:
            return None
        try:
            return Nodes.hold(due[0].folder(step))
        except OSError as exc:  # never raise before the collective
            logger.warning("lazyckpt.accelerate: cannot mark %s incomplete: %s", due[0].folder(step), exc)
            return None

    def _gather(self, index: int) -> _Gather:
        """This bare save's exchange of RNG files with the processes outside the main process's folder of
        level ``index`` (every process, in step)."""
        assert self.nodes is not None
        outside = self.nodes.outside(index)
        if outside and _compat.is_sharded_fsdp(self.accelerator):
            raise SaveRefusedError(
                f"lazyckpt.accelerate: level {index} ({self.levels[index].path}) is one node's folder, and FSDP's "
                "SHARDED_STATE_DICT saves every process's shards: save by level to folders every process shares"
            )
        rank = int(self.accelerator.process_index)
        return _Gather(self.nodes.next_seq(), outside, posts=rank in outside)

    def _agree(self, step: int) -> int:
        """Check that every process saves the same step (one collective); the refusal is raised on every process."""
        steps = sorted(set(_compat.all_gather(step)))
        if len(steps) > 1:
            raise SaveRefusedError(
                f"lazyckpt.accelerate: the processes would save different steps {steps}; set handle.step on "
                "every process alike (it counts the first prepared optimizer's real steps)"
            )
        return step

    def _produce(
        self, path: str, safe_serialization: bool, kwargs: dict[str, Any], *, gather: _Gather | None = None,
        label: str | None = None,
    ) -> SaveHandle:  # fmt: skip
        """The lazy ``save_state`` into ``path``; a handle (named ``label``, default ``path``) done once the
        folder is complete (with ``gather``: the other nodes' RNG files too)."""
        completion = Completion(label or path)

        def prepare(call: SaveStateCall) -> None:
            def settle(timeout: float | None) -> None:
                for h in list(call.handles):
                    h.wait_staged(timeout)

            def confirm_all(timeout: float | None) -> None:
                for h in list(call.handles):
                    confirm(h, timeout)

            completion.bind(settle=settle, confirm=confirm_all)
            call.on_end = lambda c: self._part_ended(c, completion, gather)
            call.rng_only = gather is not None and gather.posts

        self.owner.save_into(path, safe_serialization, kwargs, prepare=prepare)
        return completion.handle

    # -- the finisher thread, then (several processes) the watcher thread ----------------------------------
    def _part_ended(self, call: SaveStateCall, completion: Completion, gather: _Gather | None = None) -> None:
        try:
            if gather is not None and gather.posts and self.nodes is not None:  # another node's process
                error = call.error if call.failed is not None else None
                if error is None and not call.ended:
                    error = IncompleteCheckpointError(f"lazyckpt: {call.folder} was not completed")
                self.nodes.post(gather.seq, call.folder or "", error)
            if call.failed is not None:
                if self.main and gather is not None and self.nodes is not None:
                    self.nodes.forget(gather.seq, gather.outside)  # the answers that arrived already
                completion.adopt(call.failed)  # the checkpointer's report: claimed once
                completion.complete(self.producer.callbacks)
            elif self._multi is not None and self.processes > 1 and call.ended:
                if not self._others.submit((call, completion, gather)):
                    self._wait_for_others((call, completion, gather))
            else:
                error = None if call.ended else IncompleteCheckpointError(f"lazyckpt: {call.folder} was not completed")
                completion.finish(_stats(call), error, self.producer.publish, self.producer.callbacks)
        except BaseException as exc:  # noqa: BLE001 - the level handle must end
            logger.exception("lazyckpt.accelerate: ending a level save failed")
            if not completion.handle.done():
                completion.finish(None, exc, self.producer.publish, self.producer.callbacks)

    def _wait_for_others(self, item: tuple[SaveStateCall, Completion, _Gather | None]) -> None:
        """Watcher thread (main process): finish the level handle once no other process's marker is left
        and every process's RNG file is there; bounded by ``load_timeout``, ended early by a dead process's
        marker or an error another node sent."""
        call, completion, gather = item
        try:
            error = self._gathered(call, gather)
        except BaseException as exc:  # noqa: BLE001 - the level handle must end (a store error, a bug)
            logger.exception("lazyckpt.accelerate: waiting for the other processes' parts failed")
            error = exc
        completion.finish(_stats(call), error, self.producer.publish, self.producer.callbacks)

    def _gathered(self, call: SaveStateCall, gather: _Gather | None) -> BaseException | None:
        """``_wait_for_others``'s wait: None once the folder is complete, else why not."""
        folder = call.folder or ""
        outside = gather.outside if gather is not None else []
        mine = os.path.basename(gather.marker) if gather is not None and gather.marker else None
        wanted = [f"{RNG_STATE_NAME}_{i}.pkl" for i in range(self.processes) if i not in outside]
        deadline = time.monotonic() + self.owner.load_timeout
        delay = 0.005
        error: BaseException | None = None
        while True:
            markers = [m for m in pending_markers(folder) if m != mine]
            missing = [n for n in wanted if not os.path.exists(os.path.join(folder, n))]
            sent: list[str] = []
            if outside and gather is not None and self.nodes is not None:
                try:
                    outside, sent = self.nodes.collect(gather.seq, folder, outside, self.checkpointer.options.fsync)
                except OSError as exc:
                    sent = [f"writing a process's RNG file failed: {exc}"]
            if not markers and not missing and not outside and not sent:
                if gather is not None and gather.marker:
                    Nodes.release(gather.marker)
                break
            dead = [m for m in markers if marker_is_stale(m)]
            if outside and not sent and self.nodes is not None:  # their markers are on their own nodes
                gone = self.nodes.dead(outside)
                if gone:
                    sent = [f"processes {gone} died or vanished before sending their RNG files ({self.nodes.why_dead})"]
            if sent or dead or time.monotonic() >= deadline:
                why = "; ".join(sent) if sent else f"processes died during the save (markers {dead})" if dead else (
                    f"not every process finished its part within {self.owner.load_timeout:.0f} s "
                    f"(markers {markers}, missing {missing}, no RNG file yet from processes {outside})"
                )  # fmt: skip
                error = IncompleteCheckpointError(f"lazyckpt: {folder} is incomplete: {why}")
                break  # this process's gathering marker stays: the folder is incomplete
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        if error is not None and gather is not None and self.nodes is not None:
            self.nodes.forget(gather.seq, gather.outside)  # unread answers (late ones stay: small)
        return error

    # -- the handle's wait / remove ------------------------------------------------------------------
    def drain(self, timeout: float | None = None) -> None:
        """Every level save done (copies included); errors stay to be reported."""
        if self._multi is not None:
            self._multi.drain(timeout)
        for h in list(self._pending.values()):
            h.exception(timeout=timeout)

    def take_errors(self) -> list[BaseException]:
        return self._multi.take_errors() if self._multi is not None else []

    def close(self) -> None:
        self._others.stop()
        if self._multi is not None:
            self._multi.close()
        if self._holder is not None:
            self._holder.close()  # waits (bounded) for the main process's last copies
        if self.nodes is not None:
            self.nodes.close()


@dataclasses.dataclass
class _Gather:
    """One bare save's exchange of RNG files (``_nodes.py``): its number, the processes outside the main
    process's folder, whether this process is one of them (it posts), the main process's marker."""

    seq: int
    outside: list[int]
    posts: bool = False
    marker: str | None = None

    def held(self, marker: str | None) -> _Gather:
        return dataclasses.replace(self, marker=marker)


def _stats(call: SaveStateCall) -> SaveStats:
    stats = [h.stats for h in call.handles if h.stats is not None]
    return SaveStats(
        path=call.folder or "",
        bytes=sum(s.bytes for s in stats),
        file_bytes=sum(s.file_bytes for s in stats),
        blocked_s=max((s.blocked_s for s in stats), default=0.0),
        staged_s=max((s.staged_s for s in stats), default=0.0),
        durable_s=time.perf_counter() - call.started,
        write_s=max((s.write_s for s in stats), default=0.0),
        write_gbps=0.0,
        guard_wait_s=sum(s.guard_wait_s for s in stats),
    )
