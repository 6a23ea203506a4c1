"""mpicons in a torch.distributed job (gloo): the suite runs these under ``torchrun`` at 1-4 processes.

    torchrun --standalone --nproc-per-node 3 -m pytest --only-torch tests/test_torch.py

Every test is collective: each process checks what it can, the verdicts are gathered, and every
process fails alike (one process failing alone would leave the others waiting).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from helpers import (
    DISTCP_FIXTURES,
    FIXTURES,
    assert_consolidated,
    fixture_expected,
    index_weight_map,
    load_tensors,
    subprocess_env,
)

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import mpicons  # noqa: E402
import mpicons.job.pipeline  # noqa: E402
from mpicons.core.errors import InputError, Interrupted  # noqa: E402
from mpicons.torch import TorchComm, consolidate_safetensors_files_on_every_rank  # noqa: E402

pytestmark = pytest.mark.torch_dist


@pytest.fixture(scope="session")
def group() -> Iterator[object]:
    """The default group of the torchrun job (gloo), made for the session."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    yield dist.group.WORLD
    dist.barrier()


@pytest.fixture
def shared_tmp(group: object) -> Iterator[Path]:
    """One temporary directory for the whole job (rank 0's, broadcast)."""
    path = [tempfile.mkdtemp(prefix="mpicons-torch-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    yield Path(path[0])
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0], ignore_errors=True)


def agreed(check: Callable[[], None]) -> None:
    """Run ``check`` on every process; fail everywhere if it failed anywhere."""
    verdict = None
    try:
        check()
    except Exception as exc:  # noqa: BLE001 - reported on every process
        verdict = f"rank {dist.get_rank()}: {type(exc).__name__}: {exc}"
    verdicts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, verdict)
    failures = [v for v in verdicts if v]
    assert not failures, "\n".join(failures)


def on_rank_0(check: Callable[[], None]) -> Callable[[], None]:
    return lambda: check() if dist.get_rank() == 0 else None


@pytest.mark.parametrize("fixture", ["edge-3ranks", "fsdp2-3ranks", "tp2d-4ranks"])
def test_a_process_group_is_a_communicator(fixture: str, group: object, shared_tmp: Path) -> None:
    out = shared_tmp / "out"
    result = mpicons.consolidate(FIXTURES / fixture / "sharded", out, comm=group, buffer_size=1 << 12)
    expected, mapping = fixture_expected(fixture)
    agreed(lambda: None if result.stats.ranks == dist.get_world_size() else pytest.fail(f"ran on {result.stats.ranks} ranks"))
    agreed(on_rank_0(lambda: assert_consolidated(out, expected, index_weight_map(mapping))))


@pytest.mark.parametrize("fixture", ["tp2d-4ranks-optim", "dtypes-2ranks-safetensors"])
def test_a_process_group_reads_dcps_default_format(fixture: str, group: object, shared_tmp: Path) -> None:
    """``.metadata`` + ``.distcp`` through a group: every dtype, one model.safetensors, non-tensor entries skipped."""
    out = shared_tmp / "out"
    mpicons.consolidate(DISTCP_FIXTURES / fixture / "dcp", out, comm=group, buffer_size=1 << 12)
    tensors = load_tensors(DISTCP_FIXTURES / fixture / "expected" / "full.safetensors")
    agreed(on_rank_0(lambda: assert_consolidated(out, tensors, dict.fromkeys(tensors, "model.safetensors"))))


def test_mpi_is_never_started(group: object, shared_tmp: Path) -> None:
    mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", shared_tmp / "out", comm=TorchComm(group))
    agreed(lambda: None if "mpi4py.MPI" not in sys.modules else pytest.fail("mpi4py.MPI was imported"))


def test_a_group_that_cannot_move_cpu_tensors_gets_a_gloo_partner(
    group: object, shared_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An NCCL default group (played here by reporting "nccl" for it) is paired once with a gloo group."""
    real = dist.get_backend
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "nccl" if g is group else real(g))
    first, second = TorchComm(group), TorchComm(group)
    out = shared_tmp / "out"
    mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", out, comm=group)
    expected, mapping = fixture_expected("edge-3ranks")

    def paired() -> None:
        assert first.group is not group and real(first.group) == "gloo"
        assert second.group is first.group, "the gloo group is made once"
        assert dist.get_process_group_ranks(first.group) == dist.get_process_group_ranks(group)

    agreed(paired)
    agreed(on_rank_0(lambda: assert_consolidated(out, expected, index_weight_map(mapping))))


def test_a_sub_group_leaves_the_other_ranks_alone(group: object, shared_tmp: Path) -> None:
    """Ranks 0..k-1 (k = size - 1, at least 1) consolidate on their own group; the last rank does nothing."""
    size = dist.get_world_size()
    members = list(range(max(1, size - 1)))
    sub = dist.new_group(members, backend="gloo", use_local_synchronization=True) if dist.get_rank() in members else None
    out = shared_tmp / "out"
    ranks = mpicons.consolidate(FIXTURES / "tp2d-4ranks" / "sharded", out, comm=sub).stats.ranks if sub is not None else None
    agreed(lambda: None if ranks in (None, len(members)) else pytest.fail(f"ran on {ranks} ranks, not {len(members)}"))
    expected, mapping = fixture_expected("tp2d-4ranks")
    agreed(on_rank_0(lambda: assert_consolidated(out, expected, index_weight_map(mapping))))


def test_the_drop_in_writes_a_torchtitan_checkpoint_into_the_parent(group: object, shared_tmp: Path) -> None:
    """torchtitan's layout: shards in CHECKPOINT/sharded, the consolidated files in CHECKPOINT."""
    fixture = "fsdp2-3ranks"
    checkpoint = shared_tmp / "step-100"
    if dist.get_rank() == 0:
        shutil.copytree(FIXTURES / fixture / "sharded", checkpoint / "sharded")
    dist.barrier()
    expected, mapping = fixture_expected(fixture)
    consolidate_safetensors_files_on_every_rank(str(checkpoint / "sharded"), str(checkpoint), mapping, num_threads=5)
    # The shards stay in CHECKPOINT/sharded: not published, not in SHA256SUMS.
    agreed(on_rank_0(lambda: assert_consolidated(checkpoint, expected, index_weight_map(mapping), unpublished=["sharded"])))


def test_the_drop_in_refuses_the_input_as_output(group: object, shared_tmp: Path) -> None:
    """``CHECKPOINT/sharded`` → ``CHECKPOINT/sharded``: bad input on every member, nothing made among the shards
    (a directory inside the input is allowed, as torch's own tests use one)."""
    checkpoint = shared_tmp / "inside"
    if dist.get_rank() == 0:
        shutil.copytree(FIXTURES / "fsdp2-3ranks" / "sharded", checkpoint / "sharded")
    dist.barrier()
    _, mapping = fixture_expected("fsdp2-3ranks")
    with pytest.raises(InputError, match="output directory is the input directory"):
        consolidate_safetensors_files_on_every_rank(str(checkpoint / "sharded"), str(checkpoint / "sharded"), mapping)
    names, saved = (sorted(p.name for p in d.iterdir()) for d in (checkpoint / "sharded", FIXTURES / "fsdp2-3ranks" / "sharded"))
    agreed(lambda: None if names == saved else pytest.fail(f"the input now holds {names}"))


def test_the_drop_in_without_a_process_group_runs_in_one_process(group: object, shared_tmp: Path) -> None:
    """As torch's function: torch.distributed not initialized → this process alone (and no MPI)."""
    out = shared_tmp / "out"

    def alone() -> None:
        code = (
            "import json, sys\n"
            "from mpicons.torch import consolidate_safetensors_files_on_every_rank as consolidate\n"
            "mapping = {k: int(v) for k, v in json.loads(sys.argv[3]).items()}\n"
            "result = consolidate(sys.argv[1], sys.argv[2], mapping)\n"
            "assert result.stats.ranks == 1 and 'mpi4py.MPI' not in sys.modules\n"
        )
        expected, mapping = fixture_expected("fsdp2-3ranks")
        source = str(FIXTURES / "fsdp2-3ranks" / "sharded")
        out.mkdir()
        proc = subprocess.run(
            [sys.executable, "-c", code, source, str(out), json.dumps(mapping)], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        assert_consolidated(out, expected, index_weight_map(mapping))

    agreed(on_rank_0(alone))


def test_the_drop_in_holds_the_tensors_torch_makes(group: object, shared_tmp: Path) -> None:
    """torch's own function on the same float checkpoint: the same tensors (its bytes differ: no padding, no metadata)."""
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as reference

    fixture = "fsdp2-3ranks"
    expected, mapping = fixture_expected(fixture)
    ours, theirs = shared_tmp / "ours", shared_tmp / "theirs"
    if dist.get_rank() == 0:
        ours.mkdir()
        theirs.mkdir()
    dist.barrier()
    consolidate_safetensors_files_on_every_rank(str(FIXTURES / fixture / "sharded"), str(ours), mapping)
    reference.consolidate_safetensors_files_on_every_rank(str(FIXTURES / fixture / "sharded"), str(theirs), mapping)

    def same() -> None:
        for path in sorted(theirs.glob("model-*.safetensors")):
            assert load_tensors(path) == load_tensors(ours / path.name), path.name

    agreed(on_rank_0(same))


def test_an_error_on_one_member_raises_on_every_member(group: object, shared_tmp: Path) -> None:
    """Node-local shards: only the last rank's copy of one file is broken; every member raises, naming it."""
    size = dist.get_world_size()
    if dist.get_rank() == 0:
        for rank in range(size):
            shutil.copytree(FIXTURES / "edge-3ranks" / "sharded", shared_tmp / f"local-{rank}")
        victim = sorted((shared_tmp / f"local-{size - 1}").iterdir())[-1]
        victim.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    dist.barrier()

    def raises() -> None:
        with pytest.raises(InputError, match=rf"\[rank {size - 1}\]|ranks see different files"):
            mpicons.consolidate(str(shared_tmp / "local-{rank}"), shared_tmp / "out", comm=group)

    agreed(raises)
    agreed(
        on_rank_0(
            lambda: None if not (shared_tmp / "out").exists() or not any((shared_tmp / "out").iterdir()) else pytest.fail("wrote")
        )
    )


def test_node_local_shards_move_over_torch_point_to_point(group: object, shared_tmp: Path) -> None:
    """Each shard file on one rank only: pieces travel between ranks through the group's isend/irecv."""
    size = dist.get_world_size()
    if dist.get_rank() == 0:
        for rank in range(size):
            (shared_tmp / f"local-{rank}").mkdir()
        for i, path in enumerate(sorted((FIXTURES / "tp2d-4ranks" / "sharded").iterdir())):
            shutil.copy(path, shared_tmp / f"local-{i % size}" / path.name)
    dist.barrier()
    out = shared_tmp / "out"
    result = mpicons.consolidate(str(shared_tmp / "local-{rank}"), out, comm=group, buffer_size=1 << 12, progress=0.01)
    expected, mapping = fixture_expected("tp2d-4ranks")
    agreed(lambda: None if result.shared_input == (size == 1) else pytest.fail(f"shared_input {result.shared_input}"))
    agreed(on_rank_0(lambda: assert_consolidated(out, expected, index_weight_map(mapping))))


def test_mpiio_is_refused_before_any_work(group: object, shared_tmp: Path) -> None:
    def raises() -> None:
        with pytest.raises(InputError, match="--io mpiio needs an MPI communicator"):
            mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", shared_tmp / "out", comm=group, io="mpiio")

    agreed(raises)
    agreed(on_rank_0(lambda: None if not (shared_tmp / "out").exists() else pytest.fail("output directory created")))


def test_inspect_and_verify_take_a_process_group(group: object, shared_tmp: Path) -> None:
    report = mpicons.inspect(FIXTURES / "tp2d-4ranks" / "sharded", comm=group)
    out = shared_tmp / "out"
    mpicons.consolidate(FIXTURES / "tp2d-4ranks" / "sharded", out, comm=group)
    check = mpicons.verify(out, against=FIXTURES / "tp2d-4ranks" / "sharded", comm=group)
    agreed(lambda: None if report.ok and check.ok and check.ranks == dist.get_world_size() else pytest.fail(str(check.problems)))


def test_nothing_keeps_the_group_alive_after_the_call(group: object, shared_tmp: Path) -> None:
    """No reference cycle holds the communicator: a group freed only at interpreter shutdown, after
    destroy_process_group, can abort the process ("terminate called without an active exception")."""
    comm = TorchComm(group)
    alive = weakref.ref(comm)
    gc.disable()
    try:
        mpicons.consolidate(FIXTURES / "tp2d-4ranks" / "sharded", shared_tmp / "out", comm=comm, progress=0.01)
        del comm
        agreed(lambda: None if alive() is None else pytest.fail("the communicator outlived the call"))
    finally:
        gc.enable()


def test_members_passing_different_arguments_all_raise_before_any_work(group: object, shared_tmp: Path) -> None:
    """Each member its own output directory: one InputError on every member naming the argument, nothing created."""
    size = dist.get_world_size()
    mine = shared_tmp / f"out-{dist.get_rank()}"

    def raises() -> None:
        if size == 1:
            mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", mine, comm=group)
            return
        with pytest.raises(InputError, match=r"\[rank 1\] consolidate: argument output differs between ranks"):
            mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", mine, comm=group)
        with pytest.raises(InputError, match=r"\[rank 1\] inspect: argument buffer_size differs"):
            mpicons.inspect(FIXTURES / "edge-3ranks" / "sharded", comm=group, buffer_size=(1 + dist.get_rank()) << 20)

    agreed(raises)
    created = [p.name for p in shared_tmp.iterdir()]
    agreed(lambda: None if size == 1 or not created else pytest.fail(f"created {created}"))


def test_a_destroyed_group_is_an_input_error(group: object, shared_tmp: Path) -> None:
    doomed = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    dist.destroy_process_group(doomed)

    def raises() -> None:
        with pytest.raises(InputError, match="was destroyed"):
            mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", shared_tmp / "out", comm=doomed)

    agreed(raises)


def test_a_process_outside_the_group_is_an_input_error(group: object, shared_tmp: Path) -> None:
    """new_group gives the ranks it leaves out a marker, not a group: they are told so, the member consolidates."""
    first = dist.new_group([0], backend="gloo")

    def outside() -> None:
        if dist.get_rank() == 0:
            mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", shared_tmp / "out", comm=first)
            return
        for call in (lambda: mpicons.consolidate(FIXTURES / "edge-3ranks" / "sharded", shared_tmp / "x", comm=first),
                     lambda: TorchComm(first)):  # fmt: skip
            with pytest.raises(InputError, match="not a member of the process group"):
                call()

    agreed(outside)


def test_a_keyboard_interrupt_on_one_member_ends_every_member(
    group: object, shared_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C caught by the last member while it plans: every member raises Interrupted naming it (no timeout,
    here 30 s), and the interrupted member's is a KeyboardInterrupt too."""
    size = dist.get_world_size()
    victim = size - 1
    quick = dist.new_group(list(range(size)), backend="gloo", timeout=timedelta(seconds=30))
    if dist.get_rank() == victim:

        def interrupted(*args: object, **kwargs: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(mpicons.job.pipeline, "layout_of", interrupted)
    caught: list[BaseException] = []
    try:
        mpicons.consolidate(FIXTURES / "tp2d-4ranks" / "sharded", shared_tmp / "out", comm=quick)
    except BaseException as exc:  # noqa: BLE001 - checked below, on every member
        caught.append(exc)
    monkeypatch.undo()

    def every_member_interrupted() -> None:
        assert caught, "consolidate returned"
        assert isinstance(caught[0], Interrupted), repr(caught[0])
        assert str(caught[0]).startswith(f"[rank {victim}] interrupted"), str(caught[0])
        assert isinstance(caught[0], KeyboardInterrupt) == (dist.get_rank() == victim)
        assert not (shared_tmp / "out").exists() or not any((shared_tmp / "out").iterdir())

    agreed(every_member_interrupted)


def _without_torchrun(env: dict[str, str]) -> dict[str, str]:
    """This job's environment minus what torchrun set for it (a nested job gets its own)."""
    ours = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR", "MASTER_PORT")
    return {k: v for k, v in env.items() if k not in ours and not k.startswith(("TORCHELASTIC", "ROLE_", "GROUP_"))}


_KILLED_MEMBER = """
import os, signal, sys
import torch.distributed as dist
import mpicons, mpicons.job.pipeline
dist.init_process_group("gloo")
if dist.get_rank() == 2:
    mpicons.job.pipeline.layout_of = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
try:
    mpicons.consolidate(sys.argv[1], sys.argv[2], comm=dist.group.WORLD)
except Exception as exc:
    print(f"{type(exc).__name__}: {exc}", flush=True)
    os._exit(0)
os._exit(1)
"""


def test_a_killed_member_is_reported_by_the_survivors(group: object, shared_tmp: Path) -> None:
    """Three processes of their own (no torchrun agent to stop the rest): the last one is killed while it plans;
    the two survivors end promptly with mpicons' WriteError saying a member was lost."""
    import socket

    def survivors_report() -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        base = {**_without_torchrun(subprocess_env()), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "3"}
        args = [sys.executable, "-c", _KILLED_MEMBER, str(FIXTURES / "tp2d-4ranks" / "sharded"), str(shared_tmp / "out")]
        procs = [
            subprocess.Popen(args, env={**base, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for r in range(3)
        ]
        outputs = [proc.communicate(timeout=120) for proc in procs]
        assert procs[2].returncode == -9, outputs[2]
        for rank in (0, 1):
            out, err = outputs[rank]
            assert procs[rank].returncode == 0, f"rank {rank}: {out}{err}"
            assert out.startswith(f"WriteError: [rank {rank}] lost contact with "), out
            assert "died or was killed" in out and "rerun" in out, out

    agreed(on_rank_0(survivors_report))


_CLEAN_EXIT = """
import sys
import torch.distributed as dist
import mpicons
dist.init_process_group("gloo")
mpicons.consolidate(sys.argv[1], sys.argv[2] + f"-{sys.argv[3]}", comm=dist.group.WORLD, sync=False)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_three_member_jobs_exit_cleanly_every_time(group: object, shared_tmp: Path) -> None:
    """A process that exits with a gloo group still alive can abort in gloo's teardown (SIGABRT, "terminate
    called without an active exception"), whatever the collectives; after destroy_process_group mpicons leaves
    nothing behind that does: twenty 3-process torchrun jobs, pieces exchanged between members, all exit 0."""

    def clean() -> None:
        script = shared_tmp / "job.py"
        script.write_text(_CLEAN_EXIT)
        failures = []
        for run in range(20):
            proc = subprocess.run(
                [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "3", str(script),
                 str(FIXTURES / "tp2d-4ranks" / "sharded"), str(shared_tmp / "out"), str(run)],
                capture_output=True, text=True, timeout=300, env=_without_torchrun(subprocess_env(OMP_NUM_THREADS="1")),
            )  # fmt: skip
            if proc.returncode != 0 or "terminate called" in proc.stderr:
                failures.append(f"run {run}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        assert not failures, "\n".join(failures)

    agreed(on_rank_0(clean))


def test_the_environment_is_torchrun() -> None:
    """Guard: these tests mean something only inside a torchrun job."""
    assert "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
