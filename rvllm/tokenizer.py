"""Tokenizer on top of Hugging Face `tokenizers`, chat templates, and incremental detokenization.

`Tokenizer.from_pretrained` reads a model directory the way transformers 5 does
(`AutoTokenizer` with a `tokenizer.json`): the same ids from `encode`, the same
text from `decode` and `apply_chat_template`. `IncrementalDetokenizer` turns the
token stream of one request into text deltas whose concatenation is exactly
`Tokenizer.decode(output_ids)`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

logger = logging.getLogger(__name__)

# transformers writes this as model_max_length when a model sets none.
_NO_MAX_LENGTH = int(1e29)
# Special-token attributes transformers hands to every chat template, in its order.
_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
# clean_up_tokenization_spaces rewrites (" .", " n't", ...): every pattern starts with a space
# and is at most 4 characters, so text is final once its last 3 characters hold no space.
_CLEANUP_PAIRS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                  (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Tokenizer:
    """A text <-> token id codec for one model, with its special tokens and chat template.

    ``add_bos_token``/``add_eos_token``, when not None, replace the backend's post-processor
    with one that adds exactly those tokens (transformers' ``update_post_processor``); None
    keeps the backend's own. ``clean_up_tokenization_spaces`` is applied as given
    (``from_pretrained`` turns it off for BPE models, as transformers does).
    """

    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None = None,
                 eos_token: str | None = None, pad_token: str | None = None,
                 unk_token: str | None = None, chat_template: str | None = None,
                 add_bos_token: bool | None = None, add_eos_token: bool | None = None,
                 extra_eos_token_ids: Iterable[int] = (),
                 clean_up_tokenization_spaces: bool = False,
                 model_max_length: int | None = None) -> None:
        self._backend = backend
        # Encoding must never be cut or padded behind the caller's back.
        backend.no_truncation()
        backend.no_padding()
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        self.bos_token_id = _token_id(backend, bos_token)
        self.eos_token_id = _token_id(backend, eos_token)
        self.pad_token_id = _token_id(backend, pad_token)
        self.unk_token_id = _token_id(backend, unk_token)
        self.eos_token_ids: frozenset[int] = frozenset(
            i for i in (self.eos_token_id, *extra_eos_token_ids) if i is not None)
        self.chat_template = chat_template
        # Named alternatives (e.g. "tool_use") from a list-valued chat_template in the config.
        self.chat_templates: dict[str, str] = {}
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.model_max_length = model_max_length
        # Template variables beyond bos/eos/pad/unk (sep, image_token...), set by from_pretrained.
        self._extra_template_tokens: dict[str, str] = {}
        if add_bos_token is not None or add_eos_token is not None:
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
        self._refresh_vocab()
        self._encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        add_bos = add_bos and self.bos_token_id is not None
        add_eos = add_eos and self.eos_token_id is not None
        bos, eos = f"{self.bos_token}:0 ", f" {self.eos_token}:0"
        single = f"{bos if add_bos else ''}$A:0{eos if add_eos else ''}"
        pair = (f"{single}{' ' + self.bos_token + ':1' if add_bos else ''} $B:1"
                f"{' ' + self.eos_token + ':1' if add_eos else ''}")
        special = [(self.bos_token, self.bos_token_id)] if add_bos else []
        special += [(self.eos_token, self.eos_token_id)] if add_eos else []
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special)

    def _refresh_vocab(self) -> None:
        # The backend skips exactly its special added tokens when decoding.
        added = self._backend.get_added_tokens_decoder()
        self._skip_ids = frozenset(i for i, tok in added.items() if tok.special)
        named = (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id)
        self.all_special_ids = self._skip_ids | {i for i in named if i is not None}
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)
        self._max_token_chars: int | None = None
        decoder = self._backend.decoder
        decoder_json = decoder.__getstate__() if decoder is not None else b""
        # WordPiece-style decoders rewrite " ." etc. themselves; the detokenizer must know.
        self._rewrites_spaces = (self.clean_up_tokenization_spaces
                                 or b'"cleanup":true' in decoder_json)

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._backend

    def __len__(self) -> int:
        return self.vocab_size

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """Load the tokenizer of a Hugging Face model directory.

        Reads ``tokenizer.json`` (required), ``tokenizer_config.json``,
        ``special_tokens_map.json``, ``chat_template.jinja``/``chat_template.json`` and
        ``generation_config.json`` (extra EOS ids). As in transformers 5, ``tokenizer.json``'s
        post-processor decides what ``encode`` adds: the config's ``add_bos_token`` and
        ``add_eos_token`` are ignored when ``tokenizer.json`` exists. The pipeline is taken as
        written; transformers classes that rebuild it in code (``LlamaTokenizer`` with
        ``legacy: true``, for one) can differ from it, and are not imitated.
        """
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(root)!r} does not exist")
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            hint = (" (only a SentencePiece tokenizer.model is there: convert it to tokenizer.json"
                    " with transformers first)" if (root / "tokenizer.model").is_file() else "")
            raise FileNotFoundError(f"{tokenizer_file} not found{hint}")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust error types are not importable
            raise ValueError(f"cannot parse {tokenizer_file}: {exc}") from exc
        config = _read_json(root / "tokenizer_config.json") or {}
        named = _named_special_tokens(config, _read_json(root / "special_tokens_map.json"))
        _add_missing_special_tokens(backend, config, named)
        templates = _chat_templates(root, config)
        model_max_length = config.get("model_max_length")
        if not isinstance(model_max_length, int) or model_max_length >= _NO_MAX_LENGTH:
            model_max_length = None
        # transformers skips this cleanup for BPE: it would eat real spaces before punctuation.
        force_clean_up = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
        clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE" or bool(config.get(force_clean_up)))
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        tokenizer = cls(
            backend,
            bos_token=_content(named.get("bos_token")), eos_token=_content(named.get("eos_token")),
            pad_token=_content(named.get("pad_token")), unk_token=_content(named.get("unk_token")),
            chat_template=templates.get("default"),
            extra_eos_token_ids=_generation_eos_ids(root),
            clean_up_tokenization_spaces=clean_up, model_max_length=model_max_length,
        )
        tokenizer.chat_templates = templates
        tokenizer._extra_template_tokens = {
            key: _content(value) for key, value in named.items()
            if key not in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the post-processor adds."""
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_bounded(self, text: str, max_tokens: int,
                       add_special_tokens: bool = True) -> list[int] | None:
        """``encode``, or None for a text too long to be ``max_tokens`` tokens: decided
        from its length alone when it is longer than that many of the vocabulary's
        longest pieces could spell, so an over-long prompt costs no tokenizing (a
        5-million-word prompt took about 50 s and a gigabyte to tokenize)."""
        if len(text) > max_tokens * self.max_token_chars:
            return None
        return self.encode(text, add_special_tokens=add_special_tokens)

    @property
    def max_token_chars(self) -> int:
        """The most characters one token's piece has: an upper bound on the text one
        token decodes to (a byte-level piece spells each byte with one character)."""
        if self._max_token_chars is None:
            vocab = self._backend.get_vocab(with_added_tokens=True)
            self._max_token_chars = max(map(len, vocab), default=1)
        return self._max_token_chars

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; ``skip_special_tokens`` drops special added tokens."""
        if not isinstance(token_ids, list):
            token_ids = list(token_ids)
        text = self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary strings of ``ids`` (byte-level or ``▁``-marked, not decoded text)."""
        id_to_token = self._backend.id_to_token
        return [id_to_token(i) for i in ids]

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            **kwargs: Any) -> str:
        """Render a conversation to prompt text with the model's Jinja chat template.

        Renders as transformers' ``apply_chat_template(tokenize=False)`` does. ``chat_template``
        is a template string or the name of one of ``chat_templates``; other keyword arguments
        become template variables. ``continue_final_message`` ends the text right after the
        last message's content so the model continues it (not with ``add_generation_prompt``).
        """
        template = self._pick_template(chat_template, tools)
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible: "
                             "pass add_generation_prompt=False to continue the final message")
        variables = {name: value for name, value in (
            ("bos_token", self.bos_token), ("eos_token", self.eos_token),
            ("unk_token", self.unk_token), ("pad_token", self.pad_token)) if value is not None}
        variables |= self._extra_template_tokens
        variables |= kwargs
        from rvllm.chat_template import render_chat_template  # jinja2: only where chats render

        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, tools=tools,
                                    variables=variables)

    def _pick_template(self, chat_template: str | None, tools: list[dict] | None) -> str:
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=... "
                             "(or --chat-template) to render chat messages")
        return self.chat_template


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, per request.

    The deltas add up to exactly ``tokenizer.decode(output_token_ids, skip_special_tokens)``:
    the output is decoded on its own, so ``prompt_token_ids`` is kept for reference only
    (``spaces_between_special_tokens`` likewise, as the backend places special tokens itself).
    Each step decodes a short window (vLLM's prefix/read offsets), so its cost does not grow
    with the output. Text that a later token could still change is held back: an incomplete
    UTF-8 character (it decodes to U+FFFD) and, for tokenizers that rewrite " ." and the like,
    a space in the last three characters. ``flush()`` releases what is held back at the end;
    it only returns text when the output stops inside a character.

    One case cannot be streamed exactly: a byte-fallback decoder turns a whole run of byte
    tokens into U+FFFD when any byte in it is invalid, so a character already streamed from
    the run can later show as U+FFFD in ``decode``. That needs invalid UTF-8 from the model;
    valid text, and any token sequence for byte-level BPE, streams exactly.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self._skipped_ids = tokenizer._skip_ids if skip_special_tokens else frozenset()
        self._rewrites_spaces = tokenizer._rewrites_spaces
        self._output_token_ids: list[int] = []
        # The ids the decoder sees: skipped special tokens are left out, so a window never
        # starts on one (a Strip decoder would then eat the next token's leading space).
        self._ids: list[int] = []
        # Decode window: ids[prefix_offset:read_offset] gave prefix_text; text is final
        # up to read_offset.
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def output_token_ids(self) -> list[int]:
        """Every id added so far, skipped special tokens included (do not mutate)."""
        return self._output_token_ids

    def add_token(self, token_id: int) -> str:
        """Add the next generated token; return the new text ("" while it is held back)."""
        self._output_token_ids.append(token_id)
        if token_id in self._skipped_ids:
            return ""
        self._ids.append(token_id)
        return self._step(final=False)

    def flush(self) -> str:
        """Release the text held back, e.g. an incomplete character when the output ends."""
        return self._step(final=True) if self._read_offset < len(self._ids) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, final: bool) -> str:
        ids = self._ids
        window_text = self._decode(ids[self._prefix_offset:])
        # An incomplete character may also turn its whole byte-fallback run into U+FFFD,
        # so nothing is compared until the text settles.
        if not final and self._unsettled(window_text):
            return ""
        prefix_text = self._prefix_text
        if not window_text.startswith(prefix_text):
            return self._resync(final)
        if len(window_text) == len(prefix_text):
            return ""
        delta = window_text[len(prefix_text):]
        # Slide the window: the tokens just read become the prefix of the next step.
        old_read = self._read_offset
        self._read_offset = len(ids)
        if self._read_offset - self._prefix_offset > 8:
            self._prefix_offset = old_read
            window_text = self._decode(ids[old_read:])
        self._prefix_text = window_text
        return self._emit(delta)

    def _unsettled(self, text: str) -> bool:
        if text.endswith("\ufffd"):
            return True
        return self._rewrites_spaces and " " in text[-3:]

    def _resync(self, final: bool) -> str:
        # The window disagrees with what it showed before (a rewrite across its edge): fall
        # back to decoding everything once and re-anchor the window at the read offset.
        full = self._decode(self._ids)
        emitted = self.text
        if not full.startswith(emitted):
            logger.warning("detokenizer: earlier text changed after more tokens; the stream "
                           "now differs from decode() by %r", emitted[-8:])
        if not final and self._unsettled(full):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:])
        return self._emit(full[len(emitted):])

    def _emit(self, delta: str) -> str:
        self._chunks.append(delta)
        return delta


def tokenizer_from_gguf(source: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes, chat template included
    (``gguf_tokenizer``: llama.cpp's vocabularies as a ``tokenizers`` pipeline)."""
    from rvllm.gguf_tokenizer import gguf_tokenizer_args

    return Tokenizer(**gguf_tokenizer_args(source))


def load_tokenizer(model_path: str, gguf_file: str | None, tokenizer: str | None = None,
                   chat_template: str | None = None) -> Tokenizer:
    """The tokenizer a model is served with: the one at ``tokenizer`` (a directory) when
    given, else the GGUF file's own, else the model directory's; its chat template replaced
    by ``chat_template`` (a file, or the template itself) when given. Needs no torch, so the
    server's front process loads it while the engine process loads the model."""
    if tokenizer is None and gguf_file is not None:
        loaded = tokenizer_from_gguf(gguf_file)
    else:
        loaded = Tokenizer.from_pretrained(tokenizer or model_path)
    if chat_template is not None:
        path = Path(chat_template)
        loaded.chat_template = (path.read_text(encoding="utf-8") if path.is_file()
                                else chat_template)
    return loaded


def _token_id(backend: BackendTokenizer, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc


def _content(token: str | AddedToken | None) -> str | None:
    return token.content if isinstance(token, AddedToken) else token


def _added_token(value: Any, *, special: bool | None = None) -> str | AddedToken | None:
    """A config token value (a string or an AddedToken dict) as transformers reads it."""
    if not isinstance(value, dict):
        return value
    fields = {k: v for k, v in value.items() if k not in ("__type", "id")}
    if "content" not in fields:
        raise ValueError(f"special token entry {value!r} has no 'content'")
    if special is not None:
        fields["special"] = special
    return AddedToken(**fields)


def _named_special_tokens(config: dict, special_map: dict | None) -> dict[str, Any]:
    """bos/eos/... plus model-specific ones (``image_token``...), which transformers also names."""
    specific = config.get("extra_special_tokens")
    specific = dict(specific) if isinstance(specific, dict) else {}
    specific |= {key: value for key, value in config.items() if key.endswith("_token")
                 and key not in _NAMED_TOKENS
                 and (isinstance(value, str) or isinstance(value, dict) and "content" in value)}
    named = {key: _added_token(config[key]) for key in _NAMED_TOKENS if config.get(key) is not None}
    named |= {key: _added_token(value) for key, value in specific.items() if value is not None}
    # transformers reads special_tokens_map.json only for configs without added_tokens_decoder.
    if special_map and "added_tokens_decoder" not in config:
        named |= {key: _added_token(value, special=True) for key, value in special_map.items()
                  if key in _NAMED_TOKENS and value is not None}
    return named


def _add_missing_special_tokens(backend: BackendTokenizer, config: dict,
                                named: dict[str, Any]) -> None:
    """Add the config's tokens that tokenizer.json lacks, as transformers does on load."""
    present = backend.get_added_tokens_decoder().values()
    present_reprs = {repr(tok) for tok in present}
    declared = config.get("added_tokens_decoder") or {}
    to_add = [tok for _, tok in sorted((int(i), _added_token(v)) for i, v in declared.items())
              if repr(tok) not in present_reprs]
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    extra = [] if isinstance(extra, dict) else [_added_token(t) for t in extra]
    seen = {tok.content for tok in present} | {tok.content for tok in to_add}
    for token in [*named.values(), *extra]:
        if _content(token) not in seen:
            seen.add(_content(token))
            to_add.append(token)
    named_contents = {_content(v) for v in named.values()}
    for i, token in enumerate(to_add):
        if isinstance(token, str):
            to_add[i] = AddedToken(token, special=True)
        elif not token.special and token.content in named_contents:
            to_add[i] = AddedToken(token.content, single_word=token.single_word,
                                   lstrip=token.lstrip, rstrip=token.rstrip,
                                   normalized=token.normalized, special=True)
    if to_add:
        backend.add_tokens(to_add)


def _chat_templates(root: Path, config: dict) -> dict[str, str]:
    """Named chat templates; a standalone file beats tokenizer_config.json, as in transformers."""
    templates: dict[str, str] = {}
    value = config.get("chat_template")
    if isinstance(value, str):
        templates["default"] = value
    elif isinstance(value, list) and all(isinstance(t, dict) and {"name", "template"} <= t.keys()
                                         for t in value):
        templates = {t["name"]: t["template"] for t in value}
    elif value is not None:
        raise ValueError(f"{root / 'tokenizer_config.json'}: chat_template must be a string or "
                         f"a list of {{name, template}}, got {type(value).__name__}")
    legacy = _read_json(root / "chat_template.json")
    if isinstance(legacy, dict) and isinstance(legacy.get("chat_template"), str):
        templates["default"] = legacy["chat_template"]
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    return templates


def _generation_eos_ids(root: Path) -> list[int]:
    eos = (_read_json(root / "generation_config.json") or {}).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(i) for i in eos]


def _clean_up(text: str) -> str:
    for pattern, replacement in _CLEANUP_PAIRS:
        text = text.replace(pattern, replacement)
    return text


# ---- chat templates ----
