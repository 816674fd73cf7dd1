"""``pdserve bench step``'s two measuring parts: the matmul floor counts exactly the step's linear layers, and the
per-part timer gives each part its own CPU time only (nested parts are taken out of the enclosing one)."""

from __future__ import annotations

import time

import torch
from transformers import LlamaConfig

from pdserve.kernels.backend import get_attention_backend
from pdserve.loadtest.step_bench import Floor, PartTimer
from pdserve.shared.models.llama import LlamaForCausalLM


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_floor_counts_every_projection_and_the_lm_head_on_its_own_rows():
    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=2, vocab_size=500)
    model = LlamaForCausalLM(config, get_attention_backend("torch"), 64)
    model.use_fp32_matmul_weights()
    floor = Floor(model)
    # per layer, by hand: q 64x64, k and v 64x16 each, o 64x64, gate and up 64x96 each, down 96x64
    per_layer = 64 * 64 + 2 * 64 * 16 + 64 * 64 + 2 * 64 * 96 + 96 * 64
    assert floor.flops(7, 2) == 2.0 * (7 * 3 * per_layer + 2 * 64 * 500)
    assert all(w.dtype == torch.float32 for w, _ in floor.weights)  # the fp32 copies pdserve multiplies with
    cpu, wall = floor.run(20, 3)  # 20 rows: MKL's path; the skinny kernel's below 17
    assert cpu > 0 and wall > 0 and floor.run(4, 4)[0] > 0


def test_nested_parts_are_timed_exclusively_and_add_up():
    timer = PartTimer()
    inner = timer.wrap("inner", lambda: _burn(0.03))

    def outer_body():
        _burn(0.02)
        inner()
        return "result"

    outer = timer.wrap(lambda stack: "outer" if not stack else "nested-outer", outer_body)
    c0 = time.process_time()
    assert outer() == "result"
    total = time.process_time() - c0
    assert timer.calls == {"inner": 1, "outer": 1}
    assert 0.03 <= timer.cpu["inner"] < 0.06 and 0.02 <= timer.cpu["outer"] < 0.05
    assert abs(timer.cpu["inner"] + timer.cpu["outer"] - total) < 0.005
