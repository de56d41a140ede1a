"""The start-up check that --save is one directory for every rank (training.checkpointing.
check_save_is_shared), three gloo ranks: a directory local to each node (here: another
directory for rank 2) stops every rank with one line naming the ranks that cannot see it."""

from __future__ import annotations

import pathlib

from tests.distributed.harness import run_ranks


def _check(rank: int, world_size: int, dirs: list[str]) -> str:
    from megatron_het.errors import UserError
    from megatron_het.training import checkpointing
    from megatron_het.training.checkpointing import check_save_is_shared

    checkpointing._SHARED_LOOK_S = 1.0  # how long a rank looks (10 s in a run)
    try:
        check_save_is_shared(pathlib.Path(dirs[rank]), lambda ranks: f"ranks {ranks}")
    except UserError as error:
        return str(error)
    return "ok"


def test_a_save_directory_not_shared_by_every_rank_stops_them_all(tmp_path) -> None:
    shared, local = tmp_path / "shared" / "ckpt", tmp_path / "node1"
    dirs = [shared, shared, local]  # one path on a real cluster: each node's own directory
    lines = run_ranks(_check, 3, [str(d) for d in dirs], timeout=60)
    assert lines == [
        f"--save {d} is not shared by every rank: ranks [2] do not see the file rank "
        "0 wrote there; put --save (CHECKPOINT_DIR) on a filesystem every node "
        "mounts at the same path"
        for d in dirs
    ]
    assert list(shared.iterdir()) == []  # the marker is gone


def test_a_shared_save_directory_passes_and_is_left_as_it_was(tmp_path) -> None:
    save = tmp_path / "ckpt"
    assert run_ranks(_check, 3, [str(save)] * 3, timeout=60) == ["ok"] * 3
    assert save.is_dir() and list(save.iterdir()) == []


def test_a_save_directory_rank_0_cannot_write_is_named(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    lines = run_ranks(_check, 2, [str(blocker / "ckpt")] * 2, timeout=60)
    assert lines[0] == lines[1] and lines[0].startswith(
        f"rank 0 cannot write to --save {blocker / 'ckpt'} ("
    )
