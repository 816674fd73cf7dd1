"""``pdserve up`` restarts a worker that dies, as Kubernetes restarts a container: same pod id, a new
incarnation (``started_at``). A request generating on the killed decode pod moves to the other one and its
client's text equals the uninterrupted run's, and its one trace (exported to an in-test OTLP receiver) names both
decode pods; the killed pod comes back under its id; the ensemble stays up. Real processes throughout (the fault
is SIGKILL of the worker process)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pdserve.loadtest.cluster import Cluster
from support.ensemble import stream_completion
from support.otlp_receiver import OTLPReceiver

MODEL = "smollm2-135m-instruct"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def decode_pods_of(spans) -> set[str]:
    """The decode pods a trace's spans name: the router's route choice, the prefill pod's KV transfers, and the
    decode pods' own spans."""
    named = {s.attributes.get("pdserve.decode_pod") for s in spans if s.name in ("route", "kv_transfer")}
    own = {s.resource.get("service.instance.id") for s in spans if s.name == "decode"}
    return (named | own) - {None}


def test_a_killed_decode_worker_is_restarted_and_its_request_moves(tmp_path):
    with OTLPReceiver() as otlp, Cluster(
            "--prefill", "1", "--decode", "2", "--dtype", "float32", log_dir=tmp_path,
            env={"PDSERVE_POD_TTL_S": "4", "PDSERVE_MIGRATION_STALL_S": "1",
                 "OTEL_EXPORTER_OTLP_ENDPOINT": otlp.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}, process=True) as ens:
        body = {"model": MODEL, "prompt": "Write a long story about a lighthouse keeper and the sea.",
                "max_tokens": 48, "temperature": 0.8, "seed": 5, "ignore_eos": True}
        want, _ = stream_completion(ens, body)
        victim: dict = {}

        def kill_once(text: str) -> None:
            if victim or len(text) < 20:
                return
            busy = [p for p in ens.pods("decode") if ens.stats(p)["num_running"] > 0]
            assert len(busy) == 1
            victim.update(busy[0])
            os.kill(ens.child_pid("decode", victim["pod_id"]), signal.SIGKILL)

        got, finish = stream_completion(ens, body, kill_once)
        assert victim and got == want and finish == "length"
        # its trace: the root span with the migration event, and spans naming the killed pod and the survivor
        survivor = next(p["pod_id"] for p in ens.pods("decode") if p["pod_id"] != victim["pod_id"])
        moved = otlp.wait_for(lambda got: any("migration" in s.events for s in got))
        (root,) = [s for s in moved if "migration" in s.events]
        trace = otlp.wait_for(lambda got: decode_pods_of([s for s in got if s.trace_id == root.trace_id]) ==
                              {victim["pod_id"], survivor})
        trace = [s for s in trace if s.trace_id == root.trace_id]
        assert root.attributes["pdserve.decode_pods"] == [survivor]
        assert [s.resource["service.instance.id"] for s in trace if s.name == "decode"] == [survivor]
        up_out = (tmp_path / "up.out").read_text()
        assert f"pdserve up: {victim['pod_id']} exited with status -9; restarting it in 1 s" in up_out
        deadline = time.monotonic() + 120
        back = None
        while time.monotonic() < deadline and back is None:
            back = next((p for p in ens.pods("decode") if p["pod_id"] == victim["pod_id"]
                         and p["started_at"] != victim["started_at"]), None)
            time.sleep(0.5)
        assert back is not None, up_out
        assert ens.proc.poll() is None  # the ensemble is still up
        again, _ = stream_completion(ens, body)
        assert again == want
