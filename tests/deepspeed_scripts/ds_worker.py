"""One rank of a DeepSpeed test (CPU, gloo, ``DS_ACCELERATOR=cpu``): a small MLP under ZeRO ``stage``, trained
with a fixed seed, saving with the stock engine or lazyckpt's.

Usage: ds_worker.py SCENARIO RANK WORLD PORT WORKDIR (``tests/_worker.py``); the run comes from the env var
LAZYCKPT_TEST_DS (JSON: ``stage``, ``mode`` "stock" or "lazy", ``out`` the save folder, ``accum`` gradient
accumulation steps, ``bf16``, ``moe`` an MoE layer's expert-parallel size, ``frozen`` the first layer frozen
and saved with ``exclude_frozen_parameters``). Writes WORKDIR/result-<rank>.json.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import threading
import time
from datetime import timedelta

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _worker  # noqa: E402
from _util import hold_copies  # noqa: E402

ARGS = _worker.parse_argv()
SCENARIO, RANK, WORLD, PORT, WORKDIR = ARGS
RESULT: dict = {"ok": True}
CONFIG = json.loads(os.environ.get("LAZYCKPT_TEST_DS", "{}"))
OUT = CONFIG.get("out", os.path.join(WORKDIR, "ckpt"))


class MoEModel(torch.nn.Module):
    """An MLP whose hidden layer is a DeepSpeed MoE layer of 2 experts (``ep`` ranks per expert group)."""

    def __init__(self, ep: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)
        self.moe = MoE(64, torch.nn.Linear(64, 64), num_experts=2, ep_size=ep, k=1, min_capacity=4, use_rts=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _, _ = self.moe(torch.relu(self.fc1(x)))
        return self.fc2(h)


def make_engine(seed: int = 0):
    import deepspeed

    torch.manual_seed(seed)
    if CONFIG.get("moe"):  # DeepSpeed's MoE files: layer_L_expert_E_mp_rank_XX_model_states.pt, expp_rank_R_...
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        model = MoEModel(CONFIG["moe"])
        params = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                       "name": "params"})  # fmt: skip
    else:
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        model[0].requires_grad_(not CONFIG.get("frozen", False))
        params = model.parameters()
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": CONFIG.get("accum", 1),
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": CONFIG.get("stage", 2)},
        "steps_per_print": 10**9,
        "bf16": {"enabled": bool(CONFIG.get("bf16", False))},
    }
    if CONFIG.get("node_local_storage"):  # each rank a node: its first rank (LOCAL_RANK 0) writes the model states
        cfg["checkpoint"] = {"use_node_local_storage": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=cfg)
    return engine


def install(engine):
    if CONFIG.get("mode", "lazy") == "stock":
        return None
    import lazyckpt.deepspeed

    return lazyckpt.deepspeed.install(engine, commit_timeout=CONFIG.get("commit_timeout", 60))


def train(engine, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed * 1000 + RANK)
    for _ in range(steps * CONFIG.get("accum", 1)):
        x = torch.randn(4, 32, generator=g)
        y = torch.randn(4, 8, generator=g)
        out = engine(x.to(next(engine.module.parameters()).dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        engine.backward(loss)
        engine.step()


def probe(engine) -> list[float]:
    """The model's outputs on a fixed input (every rank: ZeRO-3 gathers the weights in forward)."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(123))
    with torch.no_grad():
        return engine(x.to(next(engine.module.parameters()).dtype)).float().flatten().tolist()


def listing(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)


def published_step2():
    """A lazy engine that trained 2 steps, saved global_step2, stepped once (its commit) and waited: the
    tag is published and ``latest`` names it on every rank; (engine, handle)."""
    engine = make_engine()
    handle = install(engine)
    train(engine, 2, 1)
    engine.save_checkpoint(OUT)
    train(engine, 1, 2)
    handle.wait()
    dist.barrier()
    return engine, handle


def scenario_save() -> None:
    """Train 3 steps, save (default tag, client_state), train 2, save under a custom tag, train 1, save with
    save_latest=False, train 1; the probes at each save and the final listing."""
    engine = make_engine()
    handle = install(engine)
    frozen = {"exclude_frozen_parameters": True} if CONFIG.get("frozen") else {}
    train(engine, 3, 1)
    RESULT["probe3"] = probe(engine)
    engine.save_checkpoint(OUT, client_state={"my_step": 3}, **frozen)
    RESULT["latest_after_save_returns"] = _read_latest()
    train(engine, 2, 2)
    RESULT["probe5"] = probe(engine)
    engine.save_checkpoint(OUT, tag="custom", client_state={"my_step": 5}, **frozen)
    train(engine, 1, 3)
    engine.save_checkpoint(OUT, save_latest=False, **frozen)
    train(engine, 1, 4)
    if handle is not None:
        handle.wait()
    engine.destroy()
    dist.barrier()
    RESULT["latest"] = _read_latest()
    RESULT["listing"] = listing(OUT)


def make_pipe(seed: int = 0):
    """A 2-stage ``PipelineModule`` (one stage per rank), ZeRO-1: DeepSpeed's ``layer_XX-model_states.pt`` files
    (``module.save_state_dict``) beside one model and optimizer file per stage."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    deepspeed.init_distributed("gloo")  # DeepSpeed's comm backend over this group, before the module is split
    torch.manual_seed(seed)
    lin, relu = torch.nn.Linear, torch.nn.ReLU
    net = PipelineModule(layers=[lin(32, 64), relu(), lin(64, 64), relu(), lin(64, 8)], num_stages=2,
                         loss_fn=torch.nn.MSELoss())  # fmt: skip
    cfg = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
           "zero_optimization": {"stage": 1}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), config=cfg)
    return engine


def _batches(seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)


def scenario_pipe_save() -> None:
    """A pipeline engine trains 2 batches, saves, trains 1 (its commit); the listing of the tag."""
    engine = make_pipe()
    handle = install(engine)
    batches = _batches(1)
    for _ in range(2):
        engine.train_batch(batches)
    engine.save_checkpoint(OUT)
    engine.train_batch(batches)
    if handle is not None:
        handle.wait()
    dist.barrier()
    RESULT["listing"] = listing(OUT)
    engine.destroy()


def scenario_pipe_load() -> None:
    """A stock pipeline engine loads OUT; its loss on fixed batches."""
    engine = make_pipe(seed=7)
    engine.load_checkpoint(OUT)
    RESULT["loss"] = float(engine.eval_batch(_batches(9)))
    RESULT["global_steps"] = engine.global_steps


def scenario_load() -> None:
    """A stock engine loads ``latest`` (and then global_step3) of OUT: the probes and client states."""
    engine = make_engine(seed=7)
    path, client = engine.load_checkpoint(OUT)
    RESULT["latest_probe"] = probe(engine)
    RESULT["latest_client"] = client.get("my_step")
    if not CONFIG.get("tag3", True):
        return
    path, client = engine.load_checkpoint(OUT, tag="global_step3")
    RESULT["step3_probe"] = probe(engine)
    RESULT["step3_client"] = client.get("my_step")
    RESULT["global_steps"] = engine.global_steps


def scenario_load_latest() -> None:
    """A stock engine loads ``latest`` of OUT (every file read whole, or DeepSpeed raises)."""
    engine = make_engine(seed=7)
    path, _ = engine.load_checkpoint(OUT)
    RESULT["path"] = path
    RESULT["global_steps"] = engine.global_steps
    train(engine, 1, 9)  # the loaded optimizer state steps


def scenario_second_engine_loads() -> None:
    """DeepSpeed's own checkpoint tests: engine A saves (no step after: its tag still open), a second engine B
    of the same process loads the folder by ``latest`` and by tag: B sees A's checkpoint whole."""
    a = make_engine()
    install(a)
    train(a, 2, 1)
    want = probe(a)
    a.save_checkpoint(OUT, tag="t1")
    b = make_engine(seed=7)
    install(b)
    path, _ = b.load_checkpoint(OUT)  # by latest
    RESULT["loaded"] = os.path.basename(os.path.dirname(path)) if path else None
    RESULT["same"] = probe(b) == want
    train(a, 1, 2)
    a.save_checkpoint(OUT, tag="t2")
    c = make_engine(seed=8)
    install(c)
    c.load_checkpoint(OUT, tag="t2")
    RESULT["same_by_tag"] = probe(c) == probe(a)
    train(a, 1, 3)
    a.save_checkpoint(OUT, tag="t3")  # then converted at once, as DeepSpeed's convert test does
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    out = os.path.join(WORKDIR, f"fp32-{RANK}")
    convert_zero_checkpoint_to_fp32_state_dict(OUT, out, safe_serialization=False)
    got = torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True)
    RESULT["converted"] = sorted(got) == sorted(n for n, _ in a.module.named_parameters()) and all(
        torch.equal(got[n], p.detach()) for n, p in a.module.named_parameters()
    )


def scenario_save_before_step() -> None:
    """DeepSpeed's own checkpoint tests (frozen / shared weights): saves before any step() read back at once,
    the files by torch.load and os.path, the folder by a zero_to_fp32 function imported before install; an empty
    save_dir raises stock's ValueError. After the first step a save is lazy again (its folder not there yet)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    engine = make_engine()
    install(engine)
    for bad in (None, ""):
        try:
            engine.save_checkpoint(bad)
            RESULT[f"raised_{bad}"] = None
        except Exception as exc:  # noqa: BLE001
            RESULT[f"raised_{bad}"] = type(exc).__name__
    want = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.save_checkpoint(os.path.join(OUT, "all"))
    model_file = os.path.join(OUT, "all", "global_step0", "mp_rank_00_model_states.pt")
    RESULT["model_keys"] = sorted(torch.load(model_file, weights_only=False)["module"])
    engine.save_checkpoint(os.path.join(OUT, "tagged"), tag="checkpoint")
    RESULT["size"] = os.path.getsize(os.path.join(OUT, "tagged", "checkpoint", "mp_rank_00_model_states.pt"))
    got = get_fp32_state_dict_from_zero_checkpoint(os.path.join(OUT, "tagged"), tag="checkpoint")
    RESULT["fp32_equal"] = sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    train(engine, 1, 1)
    engine.save_checkpoint(OUT)
    RESULT["lazy_after_step"] = not os.path.exists(os.path.join(OUT, "global_step1"))
    train(engine, 1, 2)  # commits it
    engine.checkpoint_engine.wait()
    RESULT["published"] = os.path.isdir(os.path.join(OUT, "global_step1")) and _read_latest() == "global_step1"


def scenario_save_raises() -> None:
    """global_step2 published; a save_checkpoint that raises on every rank at its optimizer file (after rank 0's
    model file was saved), then steps: its tag is never published, latest stays, and nothing more is raised (the
    caller saw the error). (Raised on one rank only, DeepSpeed's own barriers would go out of step, as stock.)"""
    engine, handle = published_step2()
    lazy = handle.checkpoint_engine
    save = lazy.checkpointer.save

    def failing(obj, path, *args, **kwargs):
        if "optim_states" in os.fspath(path):
            raise RuntimeError("injected: the optimizer file cannot be saved")
        return save(obj, path, *args, **kwargs)

    lazy.checkpointer.save = failing
    try:
        engine.save_checkpoint(OUT)
        RESULT["raised"] = None
    except Exception as exc:  # noqa: BLE001
        RESULT["raised"] = type(exc).__name__
    train(engine, 2, 3)
    handle.wait()
    dist.barrier()
    RESULT["latest"] = _read_latest()
    RESULT["listing"] = sorted(os.listdir(OUT))


def scenario_reentered_save() -> None:
    """A tag saved lazily and left open, then a save from inside lazyckpt (as a signal handler that interrupted
    it would): written at once through the stock engine, latest naming it on return; the older lazy tag, committed
    at the next step, never moves latest back."""
    from lazyckpt.threads import reentry

    engine, handle = published_step2()
    engine.save_checkpoint(OUT, tag="lazy3")
    with reentry.inside():
        engine.save_checkpoint(OUT, tag="sync")
    dist.barrier()
    RESULT["latest_on_return"] = _read_latest()
    RESULT["sync_files"] = sorted(os.listdir(os.path.join(OUT, "sync")))
    train(engine, 1, 3)
    handle.wait()
    dist.barrier()
    RESULT["latest"] = _read_latest()
    RESULT["listing"] = sorted(os.listdir(OUT))


def scenario_resume_same_process() -> None:
    """Save, then load right away in the same process (before any step): the handle's load waits."""
    engine = make_engine()
    handle = install(engine)
    train(engine, 2, 1)
    want = probe(engine)
    engine.save_checkpoint(OUT)
    train(engine, 1, 2)
    engine.save_checkpoint(OUT, tag="again")
    path, _ = engine.load_checkpoint(OUT)
    RESULT["loaded"] = path
    RESULT["same"] = probe(engine) != want  # "again" holds the state after the extra step
    engine.load_checkpoint(OUT, tag="global_step2")
    RESULT["same"] = probe(engine) == want
    handle.uninstall()


def scenario_enospc() -> None:
    """One good save; then rank 1's data write of the next fails with ENOSPC: every rank's wait() raises
    DistributedSaveError naming rank 1, ``latest`` still names the first tag, no second folder."""
    from lazyckpt.errors import DistributedSaveError

    engine, handle = published_step2()
    if CONFIG.get("enospc_rank", 1) == RANK:
        _fail_writes(errno.ENOSPC)
        if CONFIG.get("settle_each"):  # each file failed before the next is saved: an earlier file's error is there
            lazy = handle.checkpoint_engine
            save = lazy.checkpointer.save

            def settled(obj, path, *args, **kwargs):
                started = save(obj, path, *args, **kwargs)
                started.exception(timeout=30)
                return started

            lazy.checkpointer.save = settled
    engine.save_checkpoint(OUT)
    train(engine, 1, 3)
    try:
        handle.wait()
        RESULT["raised"] = None
    except DistributedSaveError as exc:
        RESULT["raised"] = type(exc).__name__
        RESULT["ranks"] = list(exc.ranks)
        RESULT["message"] = str(exc)
    dist.barrier()
    RESULT["latest"] = _read_latest()
    RESULT["listing"] = sorted(os.listdir(OUT))


def scenario_kill_after_save() -> None:
    """Save global_step2 and see it published; save global_step3 and SIGKILL this rank right after
    save_checkpoint returns (rank ``kill`` only; the other is killed by the test or dies with it)."""
    engine, handle = published_step2()
    engine.save_checkpoint(OUT)
    os.kill(os.getpid(), signal.SIGKILL)


def scenario_kill_before_publish() -> None:
    """global_step2 published; global_step3 saved and handed over by a step, its commit thread held before the
    folder decision; ``latest`` read there, then this rank SIGKILLed (forced window: a ``latest`` written at the
    step, as DeepSpeed's own write would be, names a tag that is not in place)."""
    engine, handle = published_step2()
    lazy = handle.checkpoint_engine
    reached = threading.Event()

    def held(*args, **kwargs):
        reached.set()
        threading.Event().wait()  # until the SIGKILL

    lazy._folders.commit = held
    engine.save_checkpoint(OUT)
    train(engine, 1, 3)  # the commit at the boundary: the tag handed to the held thread
    if not reached.wait(60):
        raise RuntimeError("the commit thread never reached the folder decision")
    with open(os.path.join(WORKDIR, f"latest-before-publish-{RANK}.txt"), "w") as fh:
        fh.write(str(_read_latest()))
    os.kill(os.getpid(), signal.SIGKILL)


def scenario_final_save() -> None:
    """The last save of a run, no step after it: engine.destroy() (CONFIG "end": "destroy") or the exit
    drain ("exit") publishes it and writes latest; the listing then."""
    engine = make_engine()
    install(engine)
    train(engine, 3, 1)
    RESULT["probe3"] = probe(engine)
    engine.save_checkpoint(OUT)
    if CONFIG["end"] == "destroy":
        engine.destroy()
    else:
        from lazyckpt.core import exit as _exit

        _exit.drain()  # what the interpreter's exit runs (the worker leaves with os._exit)
    dist.barrier()
    RESULT["latest"] = _read_latest()


def scenario_sixteen_bit() -> None:
    """save_16bit_model between a save_checkpoint and the next step (DeepSpeed calls create and commit
    itself): its file is complete when the call returns and holds the weights; the open tag is still
    committed at the next step and named by latest."""
    engine = make_engine()
    handle = install(engine)
    train(engine, 2, 1)
    engine.save_checkpoint(OUT)
    want = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    path = os.path.join(WORKDIR, "weights")
    engine.save_16bit_model(path, "model.bin")
    if RANK == 0:
        got = torch.load(os.path.join(path, "model.bin"), weights_only=False)  # there on return
        RESULT["same"] = list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    train(engine, 1, 2)
    handle.wait()
    dist.barrier()
    RESULT["latest"] = _read_latest()


def scenario_peer_dies() -> None:
    """Rank 1 is SIGKILLed right after its save_checkpoint of global_step3 returns (it never hands the tag
    over); rank 0's wait() raises DistributedSaveError naming rank 1 within seconds; latest stays."""
    from lazyckpt.errors import DistributedSaveError

    engine, handle = published_step2()
    engine.save_checkpoint(OUT)
    if RANK == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        handle.wait()
        RESULT["raised"] = None
    except DistributedSaveError as exc:
        RESULT["raised"] = type(exc).__name__
        RESULT["ranks"] = list(exc.ranks)
        RESULT["message"] = str(exc)
    RESULT["waited_s"] = time.monotonic() - t0
    RESULT["latest"] = _read_latest()
    RESULT["listing"] = sorted(os.listdir(OUT))


def scenario_kill_mid_save() -> None:
    """As kill_after_save, but the rank dies inside its data write of global_step3 (the others are killed
    by the test once they have started it)."""
    engine, handle = published_step2()
    if RANK == 1:
        _fail_writes(None)
    engine.save_checkpoint(OUT)
    train(engine, 1, 3)
    handle.wait()
    time.sleep(600)  # killed by the test


def scenario_stale() -> None:
    """A saved tensor changed in place before its copy: StaleTensorError on that rank, a typed error on
    every rank, no folder."""
    from lazyckpt.errors import DistributedSaveError

    engine = make_engine()
    handle = install(engine)
    train(engine, 2, 1)
    lazy = handle.checkpoint_engine
    real_save = lazy.checkpointer.save
    copies_may_run = threading.Event()
    hold_copies(copies_may_run)

    def save_then_change(obj, path, *a, **k):
        h = real_save(obj, path, *a, **k)
        if RANK == 0 and "optim_states" in path:  # before its copy: the copies are held until now
            obj["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["exp_avg"].add_(1.0)
        if "optim_states" in path:
            copies_may_run.set()
        return h

    lazy.checkpointer.save = save_then_change
    engine.save_checkpoint(OUT, tag="stale")
    try:
        handle.wait()
        RESULT["raised"] = None
    except DistributedSaveError as exc:
        RESULT["raised"] = type(exc).__name__
        RESULT["cause"] = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        RESULT["message"] = str(exc)
    dist.barrier()
    RESULT["listing"] = sorted(os.listdir(OUT))


def make_accelerator():
    """An Accelerator with a DeepSpeedPlugin (on CPU it counts one process; DeepSpeed's engine has both
    ranks), its prepared engine and optimizer, and lazyckpt.accelerate installed in mode "lazy"."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim

    ds = {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 4 * WORLD,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": CONFIG.get("stage", 2)}, "steps_per_print": 10**9,
    }  # fmt: skip
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    engine, opt = acc.prepare(model, DummyOptim(model.parameters()))
    handle = None
    if CONFIG.get("mode", "lazy") == "lazy":
        import lazyckpt.accelerate

        handle = lazyckpt.accelerate.install(acc)
    return acc, engine, handle


def scenario_accelerate_save() -> None:
    """save_state into s1 and s2 (a step between), a step, wait; the probes at each save, the listing."""
    acc, engine, handle = make_accelerator()
    train(engine, 2, 1)
    RESULT["probe1"] = probe(engine)
    acc.save_state(os.path.join(OUT, "s1"))
    train(engine, 1, 2)
    RESULT["probe2"] = probe(engine)
    acc.save_state(os.path.join(OUT, "s2"))
    RESULT["s2_latest_on_return"] = os.path.exists(os.path.join(OUT, "s2", "latest"))
    train(engine, 1, 3)
    if handle is not None:
        handle.wait()
    dist.barrier()
    RESULT["listing"] = listing(OUT)


def scenario_accelerate_load() -> None:
    """A stock Accelerator loads OUT/<CONFIG["folder"]>: the probe, then a step."""
    acc, engine, _ = make_accelerator()
    acc.load_state(os.path.join(OUT, CONFIG["folder"]))
    RESULT["probe"] = probe(engine)
    train(engine, 1, 9)  # the loaded optimizer state steps


def scenario_accelerate_kill() -> None:
    """s1 saved and waited for; s2 saved, then this rank SIGKILLed right after save_state returns."""
    acc, engine, handle = make_accelerator()
    train(engine, 2, 1)
    acc.save_state(os.path.join(OUT, "s1"))
    train(engine, 1, 2)
    handle.wait()
    dist.barrier()
    acc.save_state(os.path.join(OUT, "s2"))
    # Forced window: Accelerate's own files of s2 durable, the tag not committed (no step since). Without the
    # folder waiting for the tag, the finisher would remove the marker now; with it, the call is not done.
    (call,) = [c for c in handle._saves.all() if c.folder == os.path.realpath(os.path.join(OUT, "s2"))]
    for h in call.core.handles:
        h.wait()
    call.done.wait(3)
    os.kill(os.getpid(), signal.SIGKILL)


def _levels():
    from lazyckpt import Level

    base = CONFIG["levels_base"]
    fast = os.path.join(base, f"rank{RANK}") if CONFIG.get("node_local") else os.path.join(base, "fast")
    return [
        Level(fast, every=1, keep=2, replicas=CONFIG.get("replicas", 0)),
        Level(os.path.join(base, "slow"), every=2, keep=2),
    ]


def scenario_levels() -> None:
    """install(engine, levels=[fast every=1 keep=2, slow every=2 keep=2]); a save every step for 5 steps
    (save_dir "unused"), the probe at each (from step ``no_latest_from`` on with save_latest=False); with
    ``fail_copy``: rank 1's copy of step 2 into the slow level fails with ENOSPC (RESULT["raised"]: what
    handle.wait() raised then; the training goes on); with ``fail_remove``: rank 0's deletions fail."""
    import lazyckpt.deepspeed

    levels = _levels()
    engine = make_engine()
    handle = lazyckpt.deepspeed.install(engine, levels=levels, commit_timeout=60)
    if CONFIG.get("fail_remove") and RANK == 0:  # retention's deletions fail on rank 0, the folders' owner
        import shutil

        rmtree = shutil.rmtree

        def busy(path, *args, **kwargs):  # (a tag renamed away is deleted under a hidden name)
            if os.path.basename(os.fspath(path)).startswith(".global_step"):
                raise OSError(errno.EBUSY, "Device or resource busy (injected)", path)
            return rmtree(path, *args, **kwargs)

        shutil.rmtree = busy
    if CONFIG.get("fail_copy") and RANK == 1:

        def enospc():
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        _before_copy_of("global_step2", enospc)
    RESULT["probes"] = {}
    for step in range(1, 6):
        train(engine, 1, step)
        RESULT["probes"][str(engine.global_steps)] = probe(engine)
        latest = step < CONFIG.get("no_latest_from", 99)
        engine.save_checkpoint("unused", client_state={"my_step": step}, save_latest=latest)
        if step == 3 and CONFIG.get("fail_copy"):
            try:
                handle.wait()
                RESULT["raised"] = None
            except Exception as exc:  # noqa: BLE001 - reported to the test
                RESULT["raised"] = {"type": type(exc).__name__, "level": getattr(exc, "level", None),
                                    "ranks": list(getattr(exc, "ranks", ())), "message": str(exc)}  # fmt: skip
    train(engine, 1, 6)
    handle.wait()
    handle.uninstall()
    dist.barrier()
    found = lazyckpt.deepspeed.latest(levels)
    dist.barrier()  # (collective with replicas: rank 0, the store's host, exits only once every rank is past it)
    RESULT["found"] = None if found is None else [found.path, found.step, found.level]
    RESULT["listings"] = [sorted(os.listdir(lv.path)) for lv in levels]
    RESULT["unused"] = os.path.exists("unused")


def scenario_levels_held() -> None:
    """fast (every=1, keep=1) and slow (every=2): each rank's copy of global_step2 into the slow level is held
    until the fast level has published global_step3 and applied its keep (which drops global_step2 there), then
    checks that global_step2 is still at the fast level (RESULT["source_there"]): the copies run on the slow
    level's thread while the fast level goes on, and a tag being copied is pinned. RESULT["held"]: whether
    global_step3 came in time (60 s)."""
    import threading

    import lazyckpt.deepspeed
    from lazyckpt import Level
    from lazyckpt.schedule import _runner

    base = CONFIG["levels_base"]
    levels = [Level(os.path.join(base, "fast"), every=1, keep=1), Level(os.path.join(base, "slow"), every=2)]
    kept_three = threading.Event()
    retain = _runner.Runner.retain

    def retain_then_tell(self, index, sweep=False):
        retain(self, index, sweep)
        if index == 0 and not sweep and os.path.isdir(os.path.join(levels[0].path, "global_step3")):
            kept_three.set()

    def hold():
        RESULT["held"] = kept_three.wait(60)
        RESULT["source_there"] = os.path.isdir(os.path.join(levels[0].path, "global_step2"))

    _runner.Runner.retain = retain_then_tell
    _before_copy_of("global_step2", hold)
    engine = make_engine()
    handle = lazyckpt.deepspeed.install(engine, levels=levels, commit_timeout=60)
    for step in range(1, 5):
        train(engine, 1, step)
        engine.save_checkpoint("unused")
    train(engine, 1, 5)
    handle.wait()
    handle.uninstall()
    dist.barrier()
    RESULT["listings"] = [sorted(os.listdir(lv.path)) for lv in levels]


def scenario_handover_reentered() -> None:
    """A signal handler's save runs inside the hand-over of the open tag (where the hand-over queues it: the
    handler is called there instead of being sent a signal) and creates the next tag, which hands the open tag
    over first: it must not wait for that hand-over, its own interrupted frame (RESULT["hung"]: whether commit()
    was still running after 30 s; RESULT["reentered"]: what the handler saw)."""
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from lazyckpt.deepspeed import LazyCheckpointEngine
    from lazyckpt.threads import reentry

    engine = LazyCheckpointEngine()
    folder = os.path.join(OUT, "handover")
    info = CheckpointCommitInfo(tag="global_step1", save_dir=folder, save_latest=True)
    engine.create(info)
    engine.makedirs(os.path.join(folder, "global_step1"), exist_ok=True)
    submit = engine._worker.submit

    def handler_then_submit(tag):
        RESULT["reentered"] = reentry.reentered()
        engine.create(CheckpointCommitInfo(tag="global_step2", save_dir=folder, save_latest=True))
        return submit(tag)

    engine._worker.submit = handler_then_submit
    committing = threading.Thread(target=engine.commit, args=(info,), daemon=True)
    committing.start()
    committing.join(30)
    RESULT["hung"] = committing.is_alive()
    if not RESULT["hung"]:
        engine.close()


def scenario_levels_fast_fails() -> None:
    """Levels as ``levels``; steps 1-3 saved; rank 1's data write of step 4 (due at both levels) fails with
    ENOSPC: every rank's wait() raises the fast level's DistributedSaveError once (RESULT["errors"]), no level
    error for the slow level's skipped copy; step 5 is saved as usual. With ``fail_publish``: rank 1's rename
    of its node's folder of step 4 fails instead (node-local levels). RESULT["latest"]: the fast level's
    ``latest`` after each step's wait()."""
    import lazyckpt.deepspeed
    from lazyckpt.storage import fs

    levels = _levels()
    engine = make_engine()
    handle = lazyckpt.deepspeed.install(engine, levels=levels, commit_timeout=60)
    RESULT["errors"], RESULT["latest"] = [], []
    real, real_swap = fs.pwrite_all, fs.swap_in

    def swap_in(staging, final, *args):
        if os.path.basename(final) == "global_step4" and os.path.dirname(final) == levels[0].path:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real_swap(staging, final, *args)

    for step in range(1, 6):
        train(engine, 1, step)
        if step == 4 and RANK == 1:
            if CONFIG.get("fail_publish"):
                fs.swap_in = swap_in
            else:
                _fail_writes(errno.ENOSPC)
        engine.save_checkpoint("unused")
        try:
            handle.wait()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            RESULT["errors"].append([step, type(exc).__name__, getattr(exc, "level", None)])
        fs.pwrite_all, fs.swap_in = real, real_swap
        RESULT["latest"].append(lazyckpt.deepspeed.latest(levels[0].path).step)
    handle.uninstall()
    dist.barrier()
    RESULT["listings"] = [sorted(os.listdir(lv.path)) for lv in levels]


def scenario_levels_killed() -> None:
    """Levels as ``levels``; steps 1-3 saved and waited for (the slow level holds global_step2); at step 4
    rank 1 is SIGKILLed inside its copy into the slow level (the fast level has published global_step4):
    rank 0's wait() raises (RESULT["raised"]) within seconds, not at commit_timeout."""
    import lazyckpt.deepspeed

    levels = _levels()
    engine = make_engine()
    handle = lazyckpt.deepspeed.install(engine, levels=levels, commit_timeout=120)
    if RANK == 1:
        _before_copy_of("global_step4", lambda: os.kill(os.getpid(), signal.SIGKILL))
    RESULT["probes"] = {}
    for step in range(1, 5):
        train(engine, 1, step)
        RESULT["probes"][str(engine.global_steps)] = probe(engine)
        engine.save_checkpoint("unused", client_state={"my_step": step})
        if step == 3:
            handle.wait()
    t0 = time.monotonic()
    try:
        handle.wait()
        RESULT["raised"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        RESULT["raised"] = {"type": type(exc).__name__, "level": getattr(exc, "level", None), "message": str(exc)}
    RESULT["wait_s"] = time.monotonic() - t0
    RESULT["listings"] = [sorted(os.listdir(lv.path)) for lv in levels]


def scenario_levels_load() -> None:
    """Stock engines (no install) load each level's newest tag; their probes (RESULT["loaded"])."""
    import lazyckpt.deepspeed

    levels = _levels()
    RESULT["loaded"] = {}
    for level in levels:
        engine = make_engine(seed=7)
        _, client = engine.load_checkpoint(level.path)
        RESULT["loaded"][str(engine.global_steps)] = [probe(engine), client["my_step"]]
    found = lazyckpt.deepspeed.latest(levels)
    dist.barrier()  # (collective with replicas: rank 0, the store's host, exits only once every rank is past it)
    RESULT["found"] = [found.path, found.step, found.level]


def scenario_levels_restore() -> None:
    """A restart after ``levels``: latest(levels) (collective with replicas: a wiped node's tags come back from
    its peer's replicas), then a stock engine loads what it found (RESULT["loaded"]: its probe and my_step)."""
    import lazyckpt.deepspeed

    levels = _levels()
    found = lazyckpt.deepspeed.latest(levels)
    dist.barrier()  # (collective with replicas: rank 0, the store's host, exits only once every rank is past it)
    RESULT["found"] = None if found is None else [found.path, found.step, found.level]
    engine = make_engine(seed=7)
    _, client = engine.load_checkpoint(found.path)
    RESULT["loaded"] = [probe(engine), client["my_step"]]


def scenario_levels_refused() -> None:
    """install(engine, levels=...) refused on every rank (node-local levels, or replicas)."""
    import lazyckpt.deepspeed
    from lazyckpt.errors import SaveRefusedError

    engine = make_engine()
    try:
        lazyckpt.deepspeed.install(engine, levels=_levels())
        RESULT["refused"] = None
    except SaveRefusedError as exc:
        RESULT["refused"] = str(exc)
    engine.save_checkpoint(OUT)  # the stock engine stays
    dist.barrier()
    RESULT["stock"] = sorted(os.listdir(OUT))


def _before_copy_of(tag: str, action) -> None:
    """``action()`` runs on this rank's level thread as it would copy its files of ``tag`` to a slower level."""
    from lazyckpt.deepspeed import _levels

    real = _levels.copy_own_files

    def copy(source, names, staging, fsync):
        if os.path.basename(source) == tag:
            action()
        return real(source, names, staging, fsync)

    _levels.copy_own_files = copy


def _fail_writes(code: int | None) -> None:
    """This rank's next data write fails with ``code`` (None: the process is SIGKILLed there)."""
    from lazyckpt.storage import fs

    def pwrite_all(fd, data, offset):
        if code is None:
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(code, os.strerror(code))

    fs.pwrite_all = pwrite_all


def _read_latest() -> str | None:
    try:
        with open(os.path.join(OUT, "latest")) as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def init() -> None:
    from lazyckpt.core import plan

    # Small files in the background too, as with a spare core (tests/conftest.py does the same in-process).
    plan.INLINE_MAX_BYTES = plan.TINY_MAX_BYTES = 0
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT, RANK=str(RANK), WORLD_SIZE=str(WORLD),
        LOCAL_RANK="0" if CONFIG.get("node_local_storage") else str(RANK),
    )  # fmt: skip
    dist.init_process_group("gloo", rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60))


if __name__ == "__main__":
    _worker.run(ARGS, globals(), RESULT, init)
