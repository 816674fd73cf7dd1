"""``pdserve tp-worker``: node K >= 1 of a multi-node tensor-parallel engine (vLLM's ``--node-rank``).

Node 0 is a ``pdserve prefill|decode`` pod started with ``--tensor-parallel-size N --nnodes M --master-port P``;
each other node runs ``N // M`` ranks that rendezvous through ``--master-addr`` (the leader pod's address: in a
LeaderWorkerSet, ``$(LWS_LEADER_ADDRESS)``; the worker's index is ``$(LWS_WORKER_INDEX)``). Everything else (model,
dtype, KV plan) comes from the leader. Exits 0 when the leader stops the ranks, 1 with one line when the leader
cannot be reached within ``--join-timeout-s``, is lost, or a rank of this node fails.
"""

from __future__ import annotations

import logging
import sys

import click

from pdserve.shared.logs import setup_logging

logger = logging.getLogger("pdserve.tp_worker")


@click.command("tp-worker")
@click.option("--node-rank", type=click.IntRange(min=1), required=True, envvar="PDSERVE_NODE_RANK",
              help="This node's index, 1..nnodes-1 [PDSERVE_NODE_RANK].")
@click.option("--master-addr", required=True, envvar="PDSERVE_MASTER_ADDR",
              help="Address of node 0, the leader pod [PDSERVE_MASTER_ADDR].")
@click.option("--master-port", type=click.IntRange(1, 65535), default=29500, show_default=True,
              envvar="PDSERVE_MASTER_PORT", help="The leader's rendezvous port [PDSERVE_MASTER_PORT].")
@click.option("--join-timeout-s", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              envvar="PDSERVE_TP_JOIN_TIMEOUT_S", help="Give up when the leader cannot be reached this long (s).")
@click.option("--log-level", default="info", envvar="PDSERVE_LOG_LEVEL", help="debug|info|warning|error.")
def command(node_rank: int, master_addr: str, master_port: int, join_timeout_s: float, log_level: str) -> None:
    """Run node NODE_RANK of a multi-node tensor-parallel engine."""
    setup_logging(log_level)
    from pdserve.shared.engine.tp_executor import TPNodeError, run_tp_node

    logger.info("tensor-parallel node %d joining %s:%d", node_rank, master_addr, master_port)
    try:
        run_tp_node(node_rank, master_addr, master_port, join_timeout_s)
    except TPNodeError as e:
        logger.critical("%s", e)
        logging.shutdown()
        sys.exit(1)
    logger.info("tensor-parallel node %d stopped by its leader", node_rank)
