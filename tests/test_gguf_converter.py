"""The tests' GGUF writers against llama.cpp's own converter.

The GGUF tests write tiny transformers models to GGUF the way llama.cpp's
convert_hf_to_gguf.py lays each family out, then hold rvllm's loader to the original. Here
the same models go through that converter itself (from the llama-cpp-python source
distribution, fetched by scripts/fetch_test_data.py), and the two files must hold the
same tensors, bit for bit, and the same model metadata. Vocabularies are left out of the
converter's run (each family's tokenizer files would be needed): the real models'
vocabularies are tested in test_gguf_tokenizer_families.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import test_gguf
import test_gguf_families
from llama_cpp_data import require_llama_cpp_dir

# The converter, its vocabulary step skipped, run on each HF folder in turn in one process
# (one import of torch); argv: the converter's folder, then HF folder and output file pairs.
CONVERT = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf as converter
model_class = converter.get_model_class
def without_vocab(*args, **kwargs):
    cls = model_class(*args, **kwargs)
    cls.set_vocab = lambda self: None
    return cls
converter.get_model_class = without_vocab
pairs = sys.argv[2:]
for hf_dir, out in zip(pairs[::2], pairs[1::2]):
    sys.argv = ["convert_hf_to_gguf.py", hf_dir, "--outtype", "f32", "--outfile", out]
    converter.main()
"""
# Families whose converter run needs more than the model (Gemma 3 reads tokenizer.json
# outside the vocabulary step) are left out.
FAMILIES = ["llama", "qwen2", "qwen3"] + [f for f in test_gguf_families.GGUF_FAMILIES
                                          if f != "gemma3"]


def _ours(family: str, vocab: tuple[list, list, list], path: Path):  # noqa: ANN202 - a model
    path.parent.mkdir(parents=True, exist_ok=True)
    if family in ("llama", "qwen2", "qwen3"):
        model = test_gguf.tiny_model(family, len(vocab[0]))
        test_gguf.write_gguf(path, family, model, vocab)
    else:
        model = test_gguf_families.tiny_model(family, len(vocab[0]))
        arch = test_gguf_families.GGUF_FAMILIES[family][0]
        test_gguf_families.write_family_gguf(path, arch, model, vocab)
    return model


def _read(path: Path) -> tuple[dict, dict]:
    """The model metadata (not the file's general.* nor tokenizer.* keys) and the tensors
    (shape, type, bytes) of a GGUF."""
    reader = gguf.GGUFReader(path)
    meta = {f.name: f.contents() for f in reader.fields.values()
            if not f.name.startswith(("GGUF.", "general.", "tokenizer."))}
    tensors = {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name, np.array(t.data))
               for t in reader.tensors}
    return meta, tensors


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each family's GGUF as the tests write it and as llama.cpp's converter writes it."""
    converter_dir = require_llama_cpp_dir()
    root = tmp_path_factory.mktemp("converter")
    vocab = test_gguf.sentencepiece_vocab()
    files, argv = {}, []
    for family in FAMILIES:
        folder = root / family
        model = _ours(family, vocab, folder / "ours.gguf")
        model.save_pretrained(folder / "hf")
        files[family] = (folder / "ours.gguf", folder / "theirs.gguf")
        argv += [str(folder / "hf"), str(folder / "theirs.gguf")]
    run = subprocess.run([sys.executable, "-c", CONVERT, str(converter_dir), *argv],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return files


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tests_gguf_writer_agrees_with_llama_cpps_converter(family: str,
                                                                converted) -> None:
    ours_meta, ours = _read(converted[family][0])
    theirs_meta, theirs = _read(converted[family][1])
    assert sorted(ours) == sorted(theirs)
    for name, (shape, kind, data) in theirs.items():
        assert ours[name][:2] == (shape, kind), name
        assert np.array_equal(ours[name][2], data), name
    assert ours_meta == theirs_meta
