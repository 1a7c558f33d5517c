"""Loading safetensors checkpoints: each tensor is a view of the file's memory map and is
copied once, straight into its parameter in the model's dtype (no float32 copy of a
bfloat16 weight, no converted copy before the copy), and what loads is unchanged: the
same parameters however the checkpoint is stored or staged, the same greedy tokens as
transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import build_model, hf_greedy
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from rvllm import LLM, SamplingParams
from rvllm.config import ModelConfig
from rvllm.models import loader
from rvllm.models.base import skipped_checkpoint_tensor
from rvllm.models.registry import get_model_class

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=512,
               hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=0,
               eos_token_id=2)


def _build_mixtral(out_dir: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(MIXTRAL)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    return out_dir


def _recast(src: Path, dst: Path, dtype: torch.dtype, via: torch.dtype | None = None
            ) -> Path:
    """``src``'s checkpoint with every floating tensor stored as ``dtype`` (rounded
    through ``via`` first, if given), its other files copied."""
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            if t.is_floating_point():
                tensors[name] = (t.to(via) if via is not None else t).to(dtype).contiguous()
        save_file(tensors, file, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per family (llama, qwen2: tied and biased, mixtral: experts): the float32
    checkpoint, the same values stored as bfloat16, and as float32 rounded to bfloat16."""
    root = tmp_path_factory.mktemp("loading")
    out = {}
    for arch in ("llama", "qwen2", "mixtral"):
        f32 = (build_model(arch, root / arch) if arch != "mixtral"
               else _build_mixtral(root / arch))
        out[arch] = f32
        out[f"{arch}-bf16"] = _recast(f32, root / f"{arch}-bf16", torch.bfloat16)
        out[f"{arch}-rounded"] = _recast(f32, root / f"{arch}-rounded", torch.float32,
                                         via=torch.bfloat16)
    return out


def _load(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    config = ModelConfig.from_path(str(path), dtype, 128)
    return loader.load_model(config, torch.device("cpu"), cpu_linear_backend="torch")


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


class _Writes(TorchDispatchMode):
    """What each aten op writes while loading: bytes copied into existing tensors
    (``copy_``) and bytes of tensors it makes (a conversion, a clone, a concatenation),
    with the dtypes those are made in."""

    def __init__(self) -> None:
        super().__init__()
        self.copied = 0
        self.made: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        if func is torch.ops.aten.copy_.default:
            self.copied += args[0].numel() * args[0].element_size()
        else:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if (isinstance(t, torch.Tensor) and t.numel()
                        and t.untyped_storage().data_ptr() not in inputs):
                    self.made.append((str(func), t.dtype, t.numel() * t.element_size()))
        return out


def _spied_load(path: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
                ) -> tuple[torch.nn.Module, _Writes]:
    """Load ``path`` with every aten op of the weight loading (reading the files
    included: the iterator is consumed inside ``load_weights``) recorded."""
    config = ModelConfig.from_path(str(path), dtype, 128)
    cls = get_model_class(config.architecture)
    original = cls.load_weights
    writes = _Writes()

    def load_weights(self, weights):  # noqa: ANN001, ANN202
        with writes:
            return original(self, weights)

    monkeypatch.setattr(cls, "load_weights", load_weights)
    model = loader.load_model(config, torch.device("cpu"), cpu_linear_backend="torch")
    return model, writes


def test_safetensors_tensors_are_views_of_the_file_map(checkpoints: dict[str, Path]) -> None:
    """The reader copies nothing: a tensor's bytes lie in the file's memory map."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps")
    files = loader.safetensors_files(checkpoints["llama-bf16"])
    name, tensor = next(loader.iter_safetensors(files, progress=False))
    ptr = tensor.data_ptr()
    for line in maps.read_text().splitlines():
        start, end = (int(v, 16) for v in line.split()[0].split("-"))
        if start <= ptr < end:
            assert line.endswith(".safetensors"), line
            return
    pytest.fail(f"{name}'s memory is in no mapping")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
@pytest.mark.parametrize("stored,dtype", [("bf16", torch.bfloat16), ("bf16", torch.float32),
                                          ("f32", torch.float32)])
def test_each_weight_is_copied_once_in_the_model_dtype(
        checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch, arch: str,
        stored: str, dtype: torch.dtype) -> None:
    """A bfloat16 checkpoint loaded in bfloat16 makes no float32 tensor, and no checkpoint
    makes any tensor on its way: the bytes written are the parameters' bytes, once."""
    path = checkpoints[arch if stored == "f32" else f"{arch}-{stored}"]
    model, writes = _spied_load(path, dtype, monkeypatch)
    assert writes.made == []
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert writes.copied == param_bytes
    assert {p.dtype for p in model.parameters()} == {dtype}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_stored_dtype_does_not_change_what_loads(checkpoints: dict[str, Path],
                                                 arch: str) -> None:
    """bfloat16 files load into float32 exactly as float32 files of the same values do,
    and into bfloat16 exactly as float32 files rounded to bfloat16 at load do."""
    _assert_same(_params(_load(checkpoints[f"{arch}-bf16"], torch.float32)),
                 _params(_load(checkpoints[f"{arch}-rounded"], torch.float32)))
    _assert_same(_params(_load(checkpoints[f"{arch}-bf16"], torch.bfloat16)),
                 _params(_load(checkpoints[arch], torch.bfloat16)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
@pytest.mark.parametrize("stored,dtype", [("bf16", torch.bfloat16), ("f32", torch.bfloat16),
                                          ("f32", torch.float32)])
def test_staged_loading_is_byte_exact(checkpoints: dict[str, Path],
                                      monkeypatch: pytest.MonkeyPatch, arch: str, stored: str,
                                      dtype: torch.dtype) -> None:
    """The GPU's path (``DeviceStager``: pieces through a ring of buffers, the tensor
    whole in the checkpoint's dtype on the device, converted when copied into its
    parameter), run on the CPU with pieces small enough to cut every tensor and reuse
    every buffer, loads the same parameters as the direct path."""
    path = checkpoints[arch if stored == "f32" else f"{arch}-{stored}"]
    direct = _load(path, dtype)
    expected = _params(direct)
    stagers: list[loader.DeviceStager] = []
    make = loader.DeviceStager

    def stager(device: torch.device, chunk_bytes: int) -> loader.DeviceStager:
        assert 1000 < chunk_bytes <= 64 << 20
        stagers.append(make(device, chunk_bytes=1000, depth=3))
        return stagers[-1]

    monkeypatch.setattr(loader, "stages_to", lambda device: True)
    monkeypatch.setattr(loader, "DeviceStager", stager)
    _assert_same(_params(_load(path, dtype)), expected)
    files = loader.safetensors_files(path)
    assert stagers[0].bytes == sum(t.numel() * t.element_size()
                                   for name, t in loader.iter_safetensors(files, False)
                                   if not skipped_checkpoint_tensor(direct, name))


def test_stager_copies_every_dtype_and_shape() -> None:
    stager = loader.DeviceStager(torch.device("cpu"), chunk_bytes=7, depth=2)
    for t in (torch.randn(5, 3).to(torch.bfloat16), torch.randn(13), torch.tensor(2.5),
              torch.empty(0, 4), torch.arange(11, dtype=torch.int32).reshape(11, 1),
              torch.randn(4, 6)[:, ::2], torch.tensor([True, False, True])):
        out = stager(t)
        assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)
        assert t.numel() == 0 or out.data_ptr() != t.data_ptr()


def test_staging_passes_skipped_tensors_and_packed_rows_as_they_come() -> None:
    stager = loader.DeviceStager(torch.device("cpu"), chunk_bytes=16, depth=2)
    head, rows, weight = torch.ones(4, 4), object(), torch.ones(3, 4)
    out = dict(loader.staged(iter([("lm_head.weight", head), ("packed", rows),
                                   ("w", weight)]), stager,
                             lambda name: name == "lm_head.weight"))
    assert out["lm_head.weight"] is head and out["packed"] is rows
    assert out["w"] is not weight and torch.equal(out["w"], weight)
    assert stager.bytes == weight.numel() * 4


def test_greedy_tokens_match_transformers(checkpoints: dict[str, Path]) -> None:
    """float32 files, and bfloat16 files loaded into float32, generate what transformers
    generates from the same values."""
    prompts = [[5, 17, 42, 9], [100, 3, 3, 250, 61, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = hf_greedy(checkpoints["llama"], prompts, 8)
    llm = LLM(str(checkpoints["llama"]), dtype="float32", max_model_len=128)
    assert [o.outputs[0].token_ids for o in llm.generate(
        prompts, params)] == expected
    rounded = hf_greedy(checkpoints["llama-rounded"], prompts, 8)
    llm = LLM(str(checkpoints["llama-bf16"]), dtype="float32", max_model_len=128)
    assert [o.outputs[0].token_ids for o in llm.generate(
        prompts, params)] == rounded


def test_bfloat16_greedy_tokens_do_not_depend_on_the_files(
        checkpoints: dict[str, Path]) -> None:
    """In bfloat16, bfloat16 files and float32 files (rounded at load) generate alike."""
    prompts = [[5, 17, 42, 9], [100, 3, 3, 250, 61, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    runs = []
    for path in (checkpoints["llama"], checkpoints["llama-bf16"]):
        llm = LLM(str(path), dtype="bfloat16", max_model_len=128)
        runs.append([o.outputs[0].token_ids for o in llm.generate(
            prompts, params)])
    assert runs[0] == runs[1]



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
@pytest.mark.parametrize("stored,dtype", [("bf16", torch.bfloat16), ("f32", torch.bfloat16),
                                          ("f32", torch.float32)])
def test_cuda_loading_matches_the_cpu(checkpoints: dict[str, Path], arch: str, stored: str,
                                      dtype: torch.dtype) -> None:
    """On a GPU the weights go through the pinned ring (``DeviceStager``) and convert on
    the device: the parameters equal the CPU's load bit for bit."""
    path = checkpoints[arch if stored == "f32" else f"{arch}-{stored}"]
    assert loader.stages_to(torch.device("cuda"))
    config = ModelConfig.from_path(str(path), dtype, 128)
    on_gpu = loader.load_model(config, torch.device("cuda"))
    expected = _params(_load(path, dtype))
    _assert_same({n: p.cpu() for n, p in _params(on_gpu).items()}, expected)
