"""`pdserve bench multi-turn`'s modes and its table, without an ensemble (the bench itself runs in
pdserve/loadtest/README.md "KV offloading tiers")."""

from __future__ import annotations

import pytest

from pdserve.loadtest.kv_routing_bench import user_message
from pdserve.loadtest.kv_tiers_bench import mode_args, one_shot_message, table, turn_message


def test_each_mode_gets_its_pool_and_tiers():
    assert mode_args("none", "24MiB", 1.0, 4.0, "/d", 0.03) == ["--kv-cache-memory", "24MiB"]
    assert mode_args("cpu", "24MiB", 1.0, 4.0, "/d", 0.03) == [
        "--kv-cache-memory", "24MiB", "--kv-offloading-size", "1.0"]
    assert mode_args("cpu+disk", "24MiB", 1.0, 4.0, "/d", 0.03) == [
        "--kv-cache-memory", "24MiB", "--kv-offloading-size", "0.03", "--kv-offloading-disk-path", "/d",
        "--kv-offloading-disk-size", "4.0"]
    assert mode_args("unlimited", "24MiB", 1.0, 4.0, "/d", 0.03) == ["--kv-cache-memory", "2GiB"]
    assert mode_args("cpu-st2", "24MiB", 1.0, 4.0, "/d", 0.03) == [
        "--kv-cache-memory", "24MiB", "--kv-offloading-size", "1.0", "--kv-offloading-store-threshold", "2"]
    assert mode_args("cpu+disk-st2", "24MiB", 1.0, 4.0, "/d", 0.03)[-2:] == ["--kv-offloading-store-threshold", "2"]
    with pytest.raises(ValueError):
        mode_args("gpu", "24MiB", 1.0, 4.0, "/d", 0.03)


def test_one_shot_prompts_are_unique():
    assert one_shot_message(1, 40) != one_shot_message(2, 40) and "item1x9" in one_shot_message(1, 40)


def test_user_turns_grow_by_a_note_unique_to_session_and_turn():
    assert turn_message(3, 1, 0) == user_message(3, 1)  # the default: the short question alone
    long = turn_message(3, 1, 200)
    assert long.startswith(user_message(3, 1)) and "s3t1w0" in long and "s3t1w27" in long
    # no two sessions or turns share a note, so no block of it is another conversation's prefix hit
    assert len({turn_message(s, t, 200) for s in range(4) for t in range(3)}) == 12


def test_the_table_gives_computed_over_new_tokens_and_mebibytes_moved():
    moved = {"kv_bytes_received": 2**21, "kv_offload_cpu_bytes_written": 2**20, "kv_offload_cpu_bytes_loaded": 2**20,
             "kv_offload_disk_bytes_written": 2**20, "kv_offload_disk_bytes_loaded": 0,
             "kv_offload_cpu_stores_skipped": 3, "kv_offload_disk_stores_skipped": 0}
    row = {"mode": "cpu+disk", "turns": 20, "ttft_p50": 0.5, "ttft_p99": 0.9, "e2e_p50": 0.7, "e2e_p99": 1.25,
           "computed_per_turn": 66.0,
           "new_per_turn": 60.0, "local_turns": 17, "moved": moved}
    assert table([row]).splitlines()[1].split() == ["cpu+disk", "20", "0.500s", "0.900s", "0.700s", "1.250s", "66.0", "60.0", "1.10",
                                                    "17", "2.0", "2.0", "1.0", "1.0", "0.0", "3"]
