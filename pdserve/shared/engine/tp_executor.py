"""Tensor parallelism inside one engine: rank 0 (the engine's own process) drives ranks 1..N-1.

Rank 0 owns the one scheduler, the one ``KVCacheManager`` and the sampler. Every step it sends the step's
inputs (token ids, positions and the attention metadata: slot mapping, block tables, lengths) to the other ranks
and all N run the same forward pass on their own heads (``pdserve/shared/models/tensor_parallel.py``), meeting in two
all-reduces per layer. Block operations (swap out/in, KV hand-over reads and writes) are sent the same way and
applied by every rank to its own KV heads, so all block tables agree by construction. Orders travel as msgpack
bytes over a gloo process group (CPU tensors also when the compute group is NCCL, as vLLM's CPU group does);
tensors and the attention metadata are msgpack extension types -- nothing is unpickled (tests/chaos/
test_security_static.py), not even between a pod's own ranks.

A rank that dies closes its gloo connections: the collective rank 0 is in fails, and ``TPRankDied`` names the
rank; a watchdog thread also notices a death between steps (``on_death``: the worker pods exit there). Liveness does
not depend on traffic: ranks 1.. wait for rank 0's next order without a deadline (an idle engine sends none, and
it may stay idle for days), and know rank 0 is gone when its connections close; rank 0's own collectives keep the
``PDSERVE_TP_TIMEOUT_S`` bound, so a rank that hangs (SIGSTOP) inside a step still fails that step with
``TPRankDied``. The rendezvous port is the kernel's choice at every start (``master_port`` 0), so a pod restarted
while an old rank still lingers never collides with it.

Multi-node (``nnodes`` > 1, vLLM's ``--nnodes``/``--node-rank``/``--master-addr``/``--master-port``): node K runs
ranks ``K * per_node .. K * per_node + per_node - 1`` (``per_node = tensor_parallel_size // nnodes``). Node 0 is the
engine; it holds the rendezvous ``TCPStore`` on ``master_port`` and writes the set-up there (model name, dtype, KV
plan: msgpack, no pickle). Nodes 1.. are ``pdserve tp-worker`` processes (``run_tp_node``): they read the set-up,
say they joined, start their ranks and beat a heartbeat counter in the store every ``HEARTBEAT_S``. Rank 0's
watchdog counts a node whose counter stands still for ``HEARTBEAT_TIMEOUT_S`` as dead (a pod or a network gone
does not always close a connection); a node that loses the store exits. In Kubernetes a LeaderWorkerSet runs
the nodes (``helm/pdserve/templates/_multinode.tpl``).
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import threading
import time
import weakref

import msgpack
import torch
import torch.distributed as dist

from pdserve.shared.engine.kv_cache import KVCache, KVCacheSpec
from pdserve.shared.models.tensor_parallel import TPShard, check_tp_split, owner_ranks

logger = logging.getLogger(__name__)

# "No deadline" for a rank waiting on rank 0 (gloo takes a per-operation timeout; ten years fits its clock)
IDLE_WAIT = datetime.timedelta(days=3650)
HEARTBEAT_S = 0.5  # a remote node's heartbeat period
# a remote node whose heartbeat stands still this long is dead: 10 periods, well above a scheduling hiccup
HEARTBEAT_TIMEOUT_S = float(os.environ.get("PDSERVE_TP_HEARTBEAT_TIMEOUT_S", "5"))
SETUP_KEY = "pdserve/tp/setup"


def _joined_key(node: int) -> str:
    return f"pdserve/tp/joined/{node}"


def _heartbeat_key(node: int) -> str:
    return f"pdserve/tp/heartbeat/{node}"


class TPRankDied(RuntimeError):
    """A tensor-parallel rank process exited or stopped answering; the engine cannot continue."""


class TPNodeError(RuntimeError):
    """A ``pdserve tp-worker`` node cannot reach its leader, lost it, or lost one of its own ranks (one line)."""


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:300]


def collective_timeout() -> datetime.timedelta:
    """``PDSERVE_TP_TIMEOUT_S`` (default 300 s), read at each engine start: the backstop for a collective that
    never completes (a peer hung, not dead) and for the rendezvous. Never applied to a rank's wait for orders."""
    return datetime.timedelta(seconds=float(os.environ.get("PDSERVE_TP_TIMEOUT_S", "300")))


def _groups(store, rank: int, size: int, device: str):
    """``(control, compute)`` process groups: gloo for the orders, gloo or NCCL (on CUDA) for the all-reduces."""
    ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, size, collective_timeout())
    if not device.startswith("cuda"):
        return ctrl, ctrl
    return ctrl, dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size)


_TENSOR, _METADATA = 1, 2  # msgpack extension codes of the orders


def _pack_default(obj):
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()  # any dtype, bf16 included (numpy has none)
        return msgpack.ExtType(_TENSOR, msgpack.packb([str(t.dtype).removeprefix("torch."), list(t.shape), raw]))
    from pdserve.kernels.attention_metadata import AttentionMetadata

    if isinstance(obj, AttentionMetadata):
        fields = [obj.slot_mapping, obj.block_tables, obj.seq_lens, obj.query_start_loc, obj.query_lens_cpu,
                  obj.seq_lens_cpu, obj.block_size, obj.cache.get("qsl")]  # the only scratch a rank reuses
        return msgpack.ExtType(_METADATA, _pack(fields))
    raise TypeError(f"a tensor-parallel order cannot carry {type(obj).__name__}")


def _ext_hook(code: int, data: bytes):
    if code == _TENSOR:
        dtype, shape, raw = msgpack.unpackb(data)
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).reshape(shape)
    if code == _METADATA:
        from pdserve.kernels.attention_metadata import AttentionMetadata

        *tensors_and_lists, block_size, qsl = _unpack(data)
        return AttentionMetadata(*tensors_and_lists, block_size, {"qsl": qsl} if qsl is not None else {})
    return msgpack.ExtType(code, data)


def _pack(message) -> bytes:
    return msgpack.packb(message, default=_pack_default)


def _unpack(data: bytes):
    return msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False)


def _send(ctrl, message) -> None:
    data = torch.frombuffer(bytearray(_pack(message)), dtype=torch.uint8)
    ctrl.broadcast([torch.tensor([data.numel()], dtype=torch.long)], dist.BroadcastOptions()).wait()
    ctrl.broadcast([data], dist.BroadcastOptions()).wait()


def _recv(ctrl):
    """The next order from rank 0, waited for without a deadline: rank 0 sends none while idle, and its death
    closes the connection (a ``RuntimeError`` here). The order's body follows at once, under the group's timeout."""
    size = torch.zeros(1, dtype=torch.long)
    idle = dist.BroadcastOptions()
    idle.timeout = IDLE_WAIT
    ctrl.broadcast([size], idle).wait()
    data = torch.empty(int(size), dtype=torch.uint8)
    ctrl.broadcast([data], dist.BroadcastOptions()).wait()
    return _unpack(data.numpy().tobytes())


def _md_on(md, device):
    """The step's attention metadata with its tensors on ``device`` (the CPU to travel, a rank's GPU to run)."""
    from pdserve.kernels.attention_metadata import AttentionMetadata

    return AttentionMetadata(md.slot_mapping.to(device), md.block_tables.to(device), md.seq_lens.to(device),
                             md.query_start_loc.to(device), md.query_lens_cpu, md.seq_lens_cpu, md.block_size,
                             {"qsl": md.cache["qsl"]} if "qsl" in md.cache else {})


def rank_device(device: str, local_rank: int) -> str:
    """The device of the rank that is ``local_rank``-th on its node (one GPU per rank on a node)."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else device


def _build_rank(config, model_dir, model_config, dtype, shard: TPShard, plan, max_model_len: int):
    """This rank's model shard and KV cache (its KV heads only)."""
    from pdserve.kernels.backend import get_attention_backend
    from pdserve.shared.models.loader import load_model

    device = rank_device(config.device, shard.rank % (shard.size // config.nnodes))
    backend = get_attention_backend(config.attention_backend, device)
    model = load_model(model_dir, model_config, backend, dtype, device, max_model_len, shard)
    spec = local_kv_spec(model_config, config.block_size, dtype, shard.size)
    return model, KVCache(spec, plan.num_blocks, plan.num_cpu_blocks, device)


def local_kv_spec(model_config, block_size: int, dtype, tp_size: int) -> KVCacheSpec:
    """One rank's KV layout: its share of the KV heads (one replicated head when there are fewer than ranks)."""
    full = KVCacheSpec.from_model_config(model_config, block_size, dtype)
    heads = TPShard(0, tp_size).kv_heads(full.num_kv_heads)[1]
    return KVCacheSpec(full.num_layers, heads, full.head_dim, block_size, dtype)


def _rank_main(rank: int, size: int, addr: str, port: int, config, model_dir, model_config, dtype, plan,
               max_model_len: int) -> None:
    """Process entry of rank ``rank`` > 0: join the groups, load the shard, then obey rank 0 until ``stop``."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // (size // config.nnodes)))
    store = dist.TCPStore(addr, port, size, is_master=False, timeout=collective_timeout())
    ctrl, compute = _groups(store, rank, size, config.device)
    model, kv = _build_rank(config, model_dir, model_config, dtype, TPShard(rank, size, compute), plan, max_model_len)
    caches = [kv.layer(i) for i in range(kv.spec.num_layers)]
    owners = {r: (first, count) for r, first, count in owner_ranks(model_config.num_key_value_heads, size)}
    first_head = TPShard(rank, size).kv_heads(model_config.num_key_value_heads)[0]
    ready = dist.BarrierOptions()
    ready.timeout = IDLE_WAIT  # rank 0 may load its shard more slowly than the collective timeout
    ctrl.barrier(ready).wait()
    with torch.inference_mode():
        while True:
            op, payload = _recv(ctrl)
            if op == "step":
                ids, pos, md = payload
                dev = kv.kv.device
                model(ids.to(dev), pos.to(dev), caches, md if dev.type == "cpu" else _md_on(md, dev))
            elif op == "swap_out":
                kv.swap_out(payload)
            elif op == "swap_in":
                kv.swap_in(payload)
            elif op == "read":
                if rank in owners:
                    ctrl.send([kv.read_blocks(payload).cpu()], 0, 0).wait()
            elif op == "write":
                block_ids, data = payload
                kv.write_blocks(block_ids, data[:, :, :, :, first_head:first_head + kv.spec.num_kv_heads])
            elif op == "stop":
                return


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: start them, send them orders, notice their death, stop them."""

    def __init__(self, config, model_dir, model_config, dtype, plan, max_model_len: int) -> None:
        size = config.tensor_parallel_size
        self.size, self.nnodes, per_node = size, config.nnodes, size // config.nnodes
        # the server listens on every interface: nodes 1.. connect to master_addr (the leader pod's address). Port 0
        # (one node): the kernel picks a free one as it binds, a fresh one at every start, so no race with another
        # process and no clash with an old rank of a restarted pod that still holds its predecessor's (fork
        # inherits the listening socket)
        self.timeout = collective_timeout()
        store = dist.TCPStore("127.0.0.1", config.master_port, size, is_master=True, timeout=self.timeout,
                              wait_for_workers=False)
        port = store.port
        self._store, self._node_dead = store, None
        self.on_death = None  # called with the TPRankDied when a rank exits (watchdog thread) or a step fails on it
        if config.nnodes > 1:
            store.set(SETUP_KEY, _pack({"model": config.model, "dtype": str(dtype).removeprefix("torch."),
                                        "block_size": config.block_size, "device": config.device,
                                        "attention_backend": config.attention_backend, "tensor_parallel_size": size,
                                        "nnodes": config.nnodes, "model_dir": str(model_dir),
                                        "plan": [plan.num_blocks, plan.num_cpu_blocks, max_model_len]}))
        # fork on CPU (vLLM's default too): a rank starts in a moment instead of importing torch and transformers
        # again; CUDA cannot be forked once initialised, so spawn there (the caller then needs a __main__ guard)
        ctx = multiprocessing.get_context("spawn" if config.device.startswith("cuda") else "fork")
        self.procs = [ctx.Process(target=_quiet_rank_main, name=f"pdserve-tp-rank{r}", daemon=True,
                                  args=(r, size, "127.0.0.1", port, config, model_dir, model_config, dtype, plan,
                                        max_model_len))
                      for r in range(1, per_node)]
        for p in self.procs:
            p.start()
        self._closed = threading.Event()
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._closed, None)
        if config.nnodes > 1:
            self._wait_for_nodes(config, port)
        self.ctrl, compute = self._guard(_groups, store, 0, size, config.device)
        self.shard = TPShard(0, size, compute)
        self.model, kv = _build_rank(config, model_dir, model_config, dtype, self.shard, plan, max_model_len)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._closed, self.ctrl)
        self._guard(lambda: self.ctrl.barrier().wait())
        full = KVCacheSpec.from_model_config(model_config, config.block_size, dtype)
        self.kv_cache = TPKVCache(full, kv, self, owner_ranks(full.num_kv_heads, size))
        threading.Thread(target=self._watch, name="pdserve-tp-watchdog", daemon=True).start()

    def _wait_for_nodes(self, config, port: int) -> None:
        """Block until nodes 1..nnodes-1 have read the set-up; ``TPRankDied`` (one line) after
        ``tp_join_timeout_s``."""
        deadline = time.monotonic() + config.tp_join_timeout_s
        for node in range(1, config.nnodes):
            while not self._store.check([_joined_key(node)]):
                if time.monotonic() >= deadline:
                    self._finalizer()
                    raise TPRankDied(f"tensor-parallel node {node} of {config.nnodes} did not join the rendezvous on "
                                     f"port {port} within {config.tp_join_timeout_s:g} s (run `pdserve tp-worker "
                                     f"--node-rank {node} --master-addr <this pod's address> --master-port {port}`)")
                time.sleep(0.1)

    def dead_rank(self) -> TPRankDied | None:
        """The ranks that exited, as one error; None while all live. A rank killed by a signal is named first: its
        peers then fail in their collective and exit too, a moment later, with code 1."""
        dead = [(rank, p) for rank, p in enumerate(self.procs, start=1) if not p.is_alive()]
        if not dead:
            return self._node_dead
        dead.sort(key=lambda rp: (rp[1].exitcode is None or rp[1].exitcode >= 0, rp[0]))
        (rank, p), others = dead[0], "".join(f", rank {r} (pid {q.pid}) with code {q.exitcode}" for r, q in dead[1:])
        return TPRankDied(f"tensor-parallel rank {rank} of {self.size} (pid {p.pid}) exited with code {p.exitcode}"
                          f"{others}; the engine cannot continue without it")

    def stopped_rank(self) -> TPRankDied | None:
        """A local rank that is stopped (SIGSTOP, a debugger), as an error; None if none is. Asked after a collective
        timed out: that rank is the cause, while its peers that timed out waiting for it exit with code 1."""
        for rank, p in enumerate(self.procs, start=1):
            try:
                with open(f"/proc/{p.pid}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except (OSError, IndexError):  # gone, or no /proc (not Linux)
                continue
            if state in ("T", "t"):
                return TPRankDied(f"tensor-parallel rank {rank} of {self.size} (pid {p.pid}) is stopped and did not "
                                  f"answer within PDSERVE_TP_TIMEOUT_S ({self.timeout.total_seconds():g} s); "
                                  f"the engine cannot continue without it")
        return None

    def _check_heartbeats(self, beats: dict[int, tuple[int, float]]) -> None:
        """Record in ``_node_dead`` the first remote node whose heartbeat counter stood still too long."""
        per_node, now = self.size // self.nnodes, time.monotonic()
        for node in range(1, self.nnodes):
            count = int(self._store.add(_heartbeat_key(node), 0))
            last, since = beats.get(node, (-1, now))
            if count != last:
                beats[node] = (count, now)
            elif now - since > HEARTBEAT_TIMEOUT_S:
                self._node_dead = TPRankDied(
                    f"tensor-parallel node {node} of {self.nnodes} (ranks {node * per_node}..{node * per_node + per_node - 1}"
                    f" of {self.size}) sent no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s; the engine cannot continue "
                    f"without it")
                return

    def _guard(self, fn, *args):
        """Run a collective; a failure caused by a dead or a stopped rank becomes ``TPRankDied`` naming it, one that
        timed out otherwise (``PDSERVE_TP_TIMEOUT_S``: a rank hangs) ``TPRankDied`` quoting gloo. ``on_death`` hears
        of it too: the engine cannot step again, and a worker pod exits rather than serve 503s with a dead engine
        thread."""
        try:
            return fn(*args)
        except RuntimeError as e:
            error = self.stopped_rank()
            for _ in range(0 if error else 20):  # the peer's exit may be a moment behind the closed connection
                error = self.dead_rank()
                if error is not None:
                    break
                self._closed.wait(0.1)
            error = error or TPRankDied(f"tensor-parallel collective failed (a rank hangs, or it or its network is "
                                        f"gone): {_first_line(e)}")
            if self.on_death is not None:
                self.on_death(error)
            raise error from e

    def guarded(self, fn, *args):
        """``fn(*args)`` for rank 0's part of a step (its forward pass meets the other ranks in all-reduces): a rank
        that dies or hangs in it raises ``TPRankDied``, as in ``send``."""
        return self._guard(fn, *args)

    def _watch(self) -> None:
        beats: dict[int, tuple[int, float]] = {}
        while not self._closed.wait(0.5):
            if self.nnodes > 1 and self._node_dead is None:
                self._check_heartbeats(beats)
            dead = self.dead_rank()
            if dead is not None:
                dead = self.stopped_rank() or dead  # the peers of a stopped rank time out and exit: name the cause
                logger.error("%s", dead)
                if self.on_death is not None:
                    self.on_death(dead)
                return

    def send(self, op: str, payload) -> None:
        self._guard(_send, self.ctrl, (op, payload))

    def step(self, ids: torch.Tensor, positions: torch.Tensor, md) -> None:
        """Order one forward pass; rank 0 then runs its own (the all-reduces pair them up)."""
        self.send("step", (ids.cpu(), positions.cpu(), md if ids.device.type == "cpu" else _md_on(md, "cpu")))

    def recv_blocks(self, rank: int, like: torch.Tensor) -> torch.Tensor:
        buf = torch.empty_like(like, device="cpu")
        self._guard(lambda: self.ctrl.recv([buf], rank, 0).wait())
        return buf

    def close(self) -> None:
        """Stop every rank (idempotent); the engine is unusable afterwards."""
        self._finalizer()


def _stop(procs, closed: threading.Event, ctrl) -> None:
    closed.set()
    if ctrl is not None and all(p.is_alive() for p in procs):
        try:
            _send(ctrl, ("stop", None))
        except RuntimeError:
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


class TPKVCache:
    """Rank 0's view of the KV cache as ``KVCache``'s interface: ``layer`` is rank 0's own heads; swaps and the
    hand-over's ``read_blocks``/``write_blocks`` act on every rank, in the full-heads wire layout ``spec``."""

    def __init__(self, spec: KVCacheSpec, local: KVCache, workers: TPWorkers, owners) -> None:
        self.spec = spec
        self.local = local
        self.num_blocks = local.num_blocks
        self.tp_workers = workers
        self.owners = owners

    def layer(self, i: int):
        return self.local.layer(i)

    def swap_out(self, pairs) -> None:
        if pairs:
            self.tp_workers.send("swap_out", pairs)
            self.local.swap_out(pairs)

    def swap_in(self, pairs) -> None:
        if pairs:
            self.tp_workers.send("swap_in", pairs)
            self.local.swap_in(pairs)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """``[n, num_layers, 2, block_size, num_kv_heads (all), head_dim]``, gathered from the ranks that hold them."""
        self.tp_workers.send("read", list(block_ids))
        mine = self.local.read_blocks(block_ids)
        parts = [mine if rank == 0 else self.tp_workers.recv_blocks(rank, mine).to(mine.device)
                 for rank, _, _ in self.owners]
        return torch.cat(parts, dim=4)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of ``read_blocks``: every rank keeps its KV heads of ``data``. Raises ``ValueError`` on a shape
        or dtype mismatch."""
        s = self.spec
        want = (len(block_ids), s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_dim)
        if tuple(data.shape) != want or data.dtype != s.dtype:
            raise ValueError(f"KV blocks of shape {tuple(data.shape)} {data.dtype}, expected {want} {s.dtype}")
        self.tp_workers.send("write", (list(block_ids), data.cpu()))
        self.local.write_blocks(block_ids, data[:, :, :, :, :self.local.spec.num_kv_heads])


def start_tensor_parallel(config, model_dir, model_config, dtype, plan_kv_cache):
    """Check the split, plan the per-rank KV pool, start the ranks. Returns ``(workers, plan)``; ``workers.model``
    is rank 0's shard and ``workers.kv_cache`` its ``TPKVCache``. Raises ``ValueError`` (one line) for a split
    that cannot work, ``TPRankDied`` when a rank fails to start."""
    mc = model_config
    check_tp_split(mc.num_attention_heads, mc.num_key_value_heads, mc.intermediate_size, config.tensor_parallel_size)
    plan = plan_kv_cache(config, mc, local_kv_spec(mc, config.block_size, dtype, config.tensor_parallel_size))
    return TPWorkers(config, model_dir, mc, dtype, plan, plan.max_model_len), plan


def _quiet_rank_main(rank: int, size: int, addr: str, port: int, config, model_dir, model_config, dtype, plan,
                     max_model_len: int) -> None:
    """``_rank_main`` with its failure as a debug line and exit code 1: rank 0 or the node's supervisor says
    what failed in one line; a traceback from every rank that lost its peers would only bury it."""
    try:
        _rank_main(rank, size, addr, port, config, model_dir, model_config, dtype, plan, max_model_len)
    except BaseException as e:
        # a peer gone (the leader, or another rank) fails the collective this rank waits in: the symptom, not news
        lost_peer = "Connection closed by peer" in str(e) or "Connection reset by peer" in str(e)
        logger.log(logging.DEBUG if lost_peer else logging.ERROR, "tensor-parallel rank %d: %s", rank, _first_line(e))
        logging.shutdown()
        os._exit(1)


def _join_leader(node_rank: int, addr: str, port: int, join_timeout_s: float):
    """Connect to the leader's rendezvous and read its set-up. Returns ``(store, setup)``; raises ``TPNodeError``."""
    timeout = datetime.timedelta(seconds=join_timeout_s)
    try:
        store = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
        setup = _unpack(store.get(SETUP_KEY))
    except RuntimeError as e:  # DistNetworkError/DistStoreError: refused, unresolvable or timed out
        raise TPNodeError(f"cannot reach the tensor-parallel leader at {addr}:{port} within {join_timeout_s:g} s: "
                          f"{_first_line(e)}") from e
    if not 1 <= node_rank < setup["nnodes"]:
        raise TPNodeError(f"node rank {node_rank} is not one of the leader's worker nodes 1..{setup['nnodes'] - 1}")
    return store, setup


def _start_node_ranks(node_rank: int, addr: str, port: int, setup) -> list:
    """Start this node's rank processes from the leader's set-up (the model resolved and read on this node)."""
    from pdserve.shared.engine.config import EngineConfig
    from pdserve.shared.engine.kv_plan import KVCachePlan
    from pdserve.shared.models.loader import load_config
    from pdserve.shared.models.resolve import resolve_model

    config = EngineConfig(model=setup["model"], dtype=setup["dtype"], block_size=setup["block_size"],
                          device=setup["device"], attention_backend=setup["attention_backend"],
                          tensor_parallel_size=setup["tensor_parallel_size"], nnodes=setup["nnodes"],
                          master_port=port)
    model_dir = resolve_model(config.model)
    model_config, dtype = load_config(model_dir), config.torch_dtype()
    plan = KVCachePlan(*setup["plan"])
    size, per_node = config.tensor_parallel_size, config.tensor_parallel_size // config.nnodes
    ctx = multiprocessing.get_context("spawn" if config.device.startswith("cuda") else "fork")
    procs = [ctx.Process(target=_quiet_rank_main, name=f"pdserve-tp-rank{r}", daemon=True,
                         args=(r, size, addr, port, config, model_dir, model_config, dtype, plan, plan.max_model_len))
             for r in range(node_rank * per_node, (node_rank + 1) * per_node)]
    for p in procs:
        p.start()
    return procs


def _supervise(store, node_rank: int, procs: list, addr: str, port: int) -> None:
    """Beat the heartbeat until the ranks stop; returns when all exited 0 (the leader's ``stop``), raises
    ``TPNodeError`` when the leader is gone or a rank failed."""
    while True:
        try:
            store.add(_heartbeat_key(node_rank), 1)
        except RuntimeError as e:
            for p in procs:  # a leader that stopped the ranks cleanly, then exited: not a failure
                p.join(timeout=2)
            if all(p.exitcode == 0 for p in procs):
                return
            raise TPNodeError(f"lost the tensor-parallel leader at {addr}:{port}: {_first_line(e)}") from e
        if all(p.exitcode == 0 for p in procs):
            return
        failed = next((p for p in procs if p.exitcode not in (None, 0)), None)
        if failed is not None:
            time.sleep(HEARTBEAT_S)  # the leader going away fails every rank: say that rather than the symptom
            try:
                store.add(_heartbeat_key(node_rank), 0)
            except RuntimeError as e:
                raise TPNodeError(f"lost the tensor-parallel leader at {addr}:{port}: {_first_line(e)}") from e
            raise TPNodeError(f"tensor-parallel rank {failed.name.removeprefix('pdserve-tp-rank')} (node {node_rank}) "
                              f"exited with code {failed.exitcode}")
        time.sleep(HEARTBEAT_S)


def run_tp_node(node_rank: int, master_addr: str, master_port: int, join_timeout_s: float = 60.0) -> None:
    """Run node ``node_rank`` (>= 1) of a multi-node tensor-parallel engine whose node 0 listens on
    ``master_addr:master_port``: join, start this node's ``tensor_parallel_size // nnodes`` ranks, heartbeat, and
    return when the leader stops them. Raises ``TPNodeError`` (one line) when the leader cannot be reached within
    ``join_timeout_s`` seconds, is lost later, or a rank of this node fails; this node's ranks are stopped then."""
    store, setup = _join_leader(node_rank, master_addr, master_port, join_timeout_s)
    procs = _start_node_ranks(node_rank, master_addr, master_port, setup)
    try:
        store.set(_joined_key(node_rank), b"1")
        _supervise(store, node_rank, procs, master_addr, master_port)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
