"""Frozen PPO roles (reference, reward) with 8- or 4-bit weights: `reference.quant` / `reward.quant`.

None of the three frameworks quantizes its frozen roles; this is a harness extension, the same in every adapter:
each linear projection of the role -- transformers' Conv1D in the GPT-2 stand-in, or nn.Linear -- gets int8 or
NF4 weights from a maintained library that runs on the CPU as on CUDA (`quant_library`):
- torchao (the default): weight-only int8 (one fp32 scale a row; the forward casts the weight to the
  activations' dtype for a plain matmul) or NF4 (blocks of 64, their absmax in int8 over scaler blocks of 256);
  the quantized weights are torch tensor subclasses, so every byte they cost goes through torch's allocator;
- bitsandbytes: `Linear8bitLt` (LLM.int8, outlier threshold 6 as transformers' `load_in_8bit`) or `Linear4bit`
  (NF4, blocks of 64, compressed statistics); its CPU int8 path holds memory outside torch (docs/knobs.md).
Embeddings, the LM head tied to them and one-output score heads stay in the run's precision, as `load_in_8bit`
leaves the output embeddings. What quantization costs is measured on a probe batch in `quantize_role`: the
role's output (reference log-probabilities of the next token, reward scores) before and after, on the same tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from bench.run.spec import RunSpec

INT8_THRESHOLD = 6.0  # LLM.int8's outlier threshold, transformers' BitsAndBytesConfig default
NF4_BLOCK = 64  # weights per NF4 absmax block, in both libraries (QLoRA's)
NF4_SCALER_BLOCK = 256  # torchao's default: absmax values quantized together


class _Once(logging.Filter):
    """Lets each distinct message through once: bitsandbytes logs its fp16 cast of every int8 layer's input on
    every call ("MatMul8bitLt: inputs will be cast from ... to float16"), thousands of lines a run."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        first = message not in self._seen
        self._seen.add(message)
        return first


@dataclass(frozen=True)
class QuantizedRole:
    """What quantizing one frozen role did: the layers replaced, their weight bytes before (the run's
    precision) and after (packed weights plus their scales), and the output deviation on the probe batch."""

    mode: str
    library: str
    layers: int
    weight_bytes_before: int
    weight_bytes_after: int
    deviation_metric: str
    mean_abs_deviation: float  # mean |quantized - unquantized| over the probe batch's outputs
    mean_abs_value: float  # mean |unquantized| over the same outputs: the deviation's scale
    probe: str  # the probe batch, in words

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _linear_shape(module: torch.nn.Module) -> tuple[int, int, torch.Tensor] | None:
    """(in, out, weight as [out, in]) of a linear projection; None for anything else."""
    from transformers.pytorch_utils import Conv1D

    if isinstance(module, Conv1D):  # weight stored [in, out]
        return module.weight.shape[0], module.weight.shape[1], module.weight.detach().t()
    if type(module) is torch.nn.Linear:
        return module.in_features, module.out_features, module.weight.detach()
    return None


def _bitsandbytes_linear(mode: str, in_features: int, out_features: int, weight: torch.Tensor,
                         bias: torch.Tensor | None, device: torch.device) -> torch.nn.Module:
    import bitsandbytes as bnb

    if mode == "int8":
        layer = bnb.nn.Linear8bitLt(in_features, out_features, bias=bias is not None, has_fp16_weights=False,
                                    threshold=INT8_THRESHOLD)
        layer.weight = bnb.nn.Int8Params(weight.contiguous().clone(), requires_grad=False, has_fp16_weights=False)
    else:
        layer = bnb.nn.Linear4bit(in_features, out_features, bias=bias is not None, compute_dtype=weight.dtype,
                                  quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(weight.contiguous().clone(), requires_grad=False, quant_type="nf4")
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False)
    return layer.to(device)  # bitsandbytes quantizes the weight as it moves to its device


def nf4_scaler_block(blocks: int) -> int:
    """torchao's NF4 quantizes the absmax of every 64-weight block in groups of 256 and needs the block count
    divisible by that: the largest divisor of `blocks` up to 256 (256 on every GLM-ladder projection; smaller
    only on the tiny model, whose 64 x 64 projections have 64 blocks)."""
    return max(d for d in range(1, min(blocks, NF4_SCALER_BLOCK) + 1) if blocks % d == 0)


def _torchao_linear(mode: str, in_features: int, out_features: int, weight: torch.Tensor,
                    bias: torch.Tensor | None, device: torch.device) -> torch.nn.Module:
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    layer = torch.nn.Linear(in_features, out_features, bias=bias is not None, device=device, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias.detach())
    layer.requires_grad_(False)
    if mode == "int8":  # per-row scales; inductor's global settings are this process's business, not ours
        quantize_(layer, Int8WeightOnlyConfig(set_inductor_config=False))
    else:
        blocks = weight.numel() // NF4_BLOCK
        layer.weight = torch.nn.Parameter(to_nf4(layer.weight.detach(), NF4_BLOCK, nf4_scaler_block(blocks)),
                                          requires_grad=False)
    return layer


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _packed_bytes(layer: torch.nn.Module) -> int:
    """The quantized weight and its scales, bias excluded. torchao int8: int8 weights and an fp32 scale a row;
    torchao NF4: 4-bit codes, an int8 absmax a block of 64, one run-precision factor a scaler block; bitsandbytes
    int8: int8 weights, an fp32 scale a row (SCB); bitsandbytes NF4 (default compressed statistics): a uint8
    absmax a block of 64 and an fp32 one per 256 of those. Code tables (16 values to ~1.4 KiB a layer) are not
    counted."""
    weight = layer.weight
    if hasattr(weight, "qdata"):  # torchao Int8Tensor
        return _nbytes(weight.qdata) + _nbytes(weight.scale)
    if hasattr(weight, "quantized_scalers"):  # torchao NF4Tensor
        return _nbytes(weight.quantized_data) + _nbytes(weight.quantized_scalers) + _nbytes(
            weight.quantization_factor)
    if hasattr(weight, "SCB"):
        return _nbytes(weight) + _nbytes(weight.SCB)
    state = weight.quant_state
    nested = _nbytes(state.state2.absmax) if state.nested else 0
    return _nbytes(weight) + _nbytes(state.absmax) + nested


QUANTIZED_LINEAR = {"torchao": _torchao_linear, "bitsandbytes": _bitsandbytes_linear}


def quantize_linears(model: torch.nn.Module, mode: str, device: torch.device, library: str = "torchao"
                     ) -> tuple[int, int, int]:
    """Replace the model's linear projections in place; returns (layers, bytes before, bytes after). The
    output embedding (the LM head, tied or not: transformers' load_in_8bit keeps lm_head too; weight-only int8
    would also make a vocabulary-wide bf16 copy of it and of the logits at every forward) and one-output score
    heads are left as they are."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = []
    for name, module in model.named_modules():
        shape = _linear_shape(module)
        if shape is None or module is head or shape[1] == 1:
            continue
        targets.append((name, module, shape))
    layers = before = after = 0
    for name, module, (in_features, out_features, weight) in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        bias = getattr(module, "bias", None)
        layer = QUANTIZED_LINEAR[library](mode, in_features, out_features, weight, bias, device)
        before += weight.numel() * weight.element_size()
        after += _packed_bytes(layer)
        setattr(parent, child, layer)
        layers += 1
    return layers, before, after


Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, attention mask) -> the role's output


def _probe_tokens(spec: RunSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A fixed batch of the run's shape (batch x prompt + answer tokens, ids >= 2: clear of pad and eos, drawn
    with the run's seed), its all-ones attention mask, and the batch in words."""
    length = spec.prompt_len + spec.answer_len
    ids = torch.randint(2, spec.model.vocab, (spec.batch, length), generator=torch.Generator().manual_seed(spec.seed))
    return (ids.to(device), torch.ones_like(ids, device=device),
            f"{spec.batch} x {length} random tokens (seed {spec.seed}), the same before and after")


def quantize_reference(spec: RunSpec, model: torch.nn.Module, device: torch.device, logits: Forward
                       ) -> QuantizedRole:
    """The reference in `reference.quant`; the deviation is that of log p(next token) at every position."""
    ids, mask, probe = _probe_tokens(spec, device)

    def logprobs() -> torch.Tensor:
        logp = torch.log_softmax(logits(ids, mask)[:, :-1].float(), dim=-1)
        return logp.gather(-1, ids[:, 1:, None]).squeeze(-1)

    return quantize_role(model, spec.reference.quant, spec.quant_library, device, logprobs,
                         "reference log-prob of the next token (nats)", probe)


def quantize_reward(spec: RunSpec, model: torch.nn.Module, device: torch.device, score: Forward) -> QuantizedRole:
    """The reward model in `reward.quant`; the deviation is that of its score of each sequence."""
    ids, mask, probe = _probe_tokens(spec, device)
    return quantize_role(model, spec.reward.quant, spec.quant_library, device, lambda: score(ids, mask),
                         "reward score", probe)


def quantize_frozen_model(spec: RunSpec, role: str, model: torch.nn.Module, device: torch.device,
                          score: Forward) -> QuantizedRole:
    """A whole frozen model held outside the engines: no gradients, the run's precision on `device`, eval
    mode, then `role`'s quant ("ref": a causal LM, its log-probs compared; "reward": `score` compared)."""
    from bench.run.models import TORCH_DTYPES

    model.requires_grad_(False)
    model.to(device, TORCH_DTYPES[spec.precision]).eval()
    if role == "ref":
        return quantize_reference(spec, model, device, lambda ids, mask: model(input_ids=ids,
                                                                              attention_mask=mask).logits)
    return quantize_reward(spec, model, device, score)


def import_library(library: str) -> str:
    """Import the library (quietly where its noise is not ours) and name it with its version."""
    if library == "bitsandbytes":
        import bitsandbytes

        # it logs its fp16 cast of every int8 layer's input on every call, thousands of lines a run
        bnb_logger = logging.getLogger("bitsandbytes.autograd._functions")
        if not any(isinstance(f, _Once) for f in bnb_logger.filters):
            bnb_logger.addFilter(_Once())
        return f"bitsandbytes {bitsandbytes.__version__}"
    torchao_logger = logging.getLogger("torchao")
    if not torch.cuda.is_available():  # its CUDA-only kernel libraries (mxfp8, CUTLASS sm90a) cannot load here,
        torchao_logger.setLevel(logging.ERROR)  # and neither int8 weight-only nor NF4 uses them
    import torchao

    return f"torchao {torchao.__version__}"


def quantize_role(model: torch.nn.Module, mode: str, library: str, device: torch.device,
                  output: Callable[[], torch.Tensor], metric: str, probe: str) -> QuantizedRole:
    """Quantize `model` (a frozen role already on `device` in the run's precision) with `library` and measure
    what it costs: `output()` runs the role on the probe batch, before and after."""
    name = import_library(library)
    with torch.no_grad():
        reference = output().float()
        layers, before, after = quantize_linears(model, mode, device, library)
        quantized = output().float()
    return QuantizedRole(mode=mode, library=name, layers=layers,
                         weight_bytes_before=before, weight_bytes_after=after, deviation_metric=metric,
                         mean_abs_deviation=(quantized - reference).abs().mean().item(),
                         mean_abs_value=reference.abs().mean().item(), probe=probe)
