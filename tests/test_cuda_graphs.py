"""CUDA graph capture sizes, padding and replay bookkeeping, tested on CPU.

The runner's graph capture is replaced by a stand-in that re-runs the forward
on the static buffers at "replay", which is exactly what a graph replay
computes; everything else is the runner's own code.
"""

from __future__ import annotations

import pytest
import torch

from rvllm.executor.cuda_graphs import (
    CUDAGraphRunner,
    capture_sizes,
    fill_static_inputs,
    padded_batch_size,
)


def test_capture_sizes_are_powers_of_two_then_every_step() -> None:
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert capture_sizes(64, step=16) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_capture_sizes_always_include_max_num_seqs() -> None:
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]


def test_capture_sizes_reject_nonpositive() -> None:
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_padded_batch_size_rounds_up_to_the_next_captured_size() -> None:
    sizes = capture_sizes(32)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 8, 9, 17, 32)] == [
        1, 4, 8, 8, 16, 24, 32]
    assert padded_batch_size(33, sizes) is None


def test_fill_static_inputs_copies_the_corner_and_pads_rows() -> None:
    buffers = {"slot_mapping": torch.full((8,), 7), "block_tables": torch.full((8, 4), 9)}
    inputs = {"slot_mapping": torch.tensor([3, 5, 6]),
              "block_tables": torch.tensor([[1, 2], [3, 4], [5, 6]])}
    fill_static_inputs(buffers, inputs, 4, {"slot_mapping": -1})
    assert buffers["slot_mapping"].tolist() == [3, 5, 6, -1, 7, 7, 7, 7]
    assert buffers["block_tables"][:3, :2].tolist() == [[1, 2], [3, 4], [5, 6]]
    assert buffers["block_tables"][3].tolist() == [0, 0, 0, 0]
    assert buffers["block_tables"][4].tolist() == [9, 9, 9, 9]


class EagerReplayRunner(CUDAGraphRunner):
    """Stand-in capture: "replay" recomputes the forward into the captured outputs."""

    def _capture_one(self, inputs):
        outputs = self.forward(inputs)

        def replay() -> None:
            fresh = self.forward(inputs)
            for out, new in zip(outputs, fresh):
                out.copy_(new)

        return replay, outputs


def _runner(max_num_seqs: int = 16) -> tuple[EagerReplayRunner, list[int]]:
    seen: list[int] = []

    def forward(inputs):
        seen.append(inputs["input_ids"].shape[0])
        ids = inputs["input_ids"]
        return ids * 10, inputs["slot_mapping"].clone()

    buffers = {"input_ids": torch.zeros(max_num_seqs, dtype=torch.long),
               "slot_mapping": torch.zeros(max_num_seqs, dtype=torch.long)}
    runner = EagerReplayRunner(forward, buffers, capture_sizes(max_num_seqs),
                               pad_values={"slot_mapping": -1})
    runner.capture()
    return runner, seen


def test_runner_captures_every_size_largest_first() -> None:
    _, seen = _runner()
    assert seen == [16, 8, 4, 2, 1]


def test_runner_replays_the_padded_graph_and_slices_outputs() -> None:
    runner, seen = _runner()
    seen.clear()
    ids, slots = runner.run({"input_ids": torch.tensor([1, 2, 3]),
                             "slot_mapping": torch.tensor([4, 5, 6])})
    assert seen == [4]
    assert ids.tolist() == [10, 20, 30]
    assert slots.tolist() == [4, 5, 6]
    assert runner.buffers["slot_mapping"][:4].tolist() == [4, 5, 6, -1]


def test_runner_rejects_a_batch_larger_than_captured() -> None:
    runner, _ = _runner(4)
    with pytest.raises(ValueError, match="no CUDA graph"):
        runner.run({"input_ids": torch.zeros(5, dtype=torch.long),
                    "slot_mapping": torch.zeros(5, dtype=torch.long)})


def test_runner_rejects_buffers_smaller_than_the_largest_size() -> None:
    with pytest.raises(ValueError, match="largest capture size"):
        CUDAGraphRunner(lambda x: x["a"], {"a": torch.zeros(4)}, [1, 8])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runner_captures_and_replays_on_cuda() -> None:
    buffers = {"x": torch.zeros(8, 4, device="cuda")}
    runner = CUDAGraphRunner(lambda inputs: inputs["x"] * 2 + 1, buffers, [1, 2, 4, 8])
    runner.capture()
    x = torch.randn(3, 4, device="cuda")
    torch.testing.assert_close(runner.run({"x": x}), x * 2 + 1)
