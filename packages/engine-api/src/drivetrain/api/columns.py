"""Names and dtypes of the columns every drivetrain component agrees on.

A batch may carry any other column too; these are the ones engines, rollouts and the trainer
read without being told. Token columns are aligned with ``input_ids``: position ``t`` describes
token ``t`` of the sequence (for ``log_probs``: log p(token t | tokens < t); the first token of
each sequence has no prediction, so its value is 0 and its ``loss_mask`` must be 0).

Devices: the trainer sends CPU tensors (engines move each micro-batch to their device), and
``infer`` returns CPU tensors, in the layout of the batch it was given. :data:`DTYPES` says
each column's dtype; the engine-api README lists which columns each job sends.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

INPUT_IDS = "input_ids"  # token ids (prompt + response)
POSITION_IDS = "position_ids"  # restart at 0 for every sequence; engines derive them if absent
LOSS_MASK = "loss_mask"  # 1 for tokens the loss counts (e.g. assistant / response tokens)
RESPONSE_MASK = "response_mask"  # 1 for tokens the policy generated
LOG_PROBS = "log_probs"  # output of engines: log-prob of each token under the model
ENTROPY = "entropy"  # output of engines: entropy of the predictive distribution at each token
VALUES = "values"  # output of value-head engines: one scalar per token
OLD_LOG_PROBS = "old_log_probs"  # the actor's log-probs before this update
REF_LOG_PROBS = "ref_log_probs"  # the reference model's log-probs
ROLLOUT_LOG_PROBS = "rollout_log_probs"  # sampled log-probs reported by the rollout backend
ADVANTAGES = "advantages"
RETURNS = "returns"
REWARDS = "rewards"  # per-token rewards (the sequence reward usually on the last token)
WEIGHT_VERSION = "weight_version"  # per sample: which weights generated it (its first token)
#: per token: the weight version a generated token was sampled under (-1 on prompt tokens); a
#: sample generated across a weight update (a partial rollout) holds two or more
TOKEN_WEIGHT_VERSION = "token_weight_version"
#: Per sample, a hint: this many leading tokens (usually the prompt) may be shared with other
#: samples of the batch that start with the *same* tokens. Engines may compute such a prefix
#: once; outputs must not change (the conformance kit checks it). Engines may ignore it.
SHARED_PREFIX_LEN = "shared_prefix_len"
#: Per sample, an integer: samples with the same value are one unit of work that engines must
#: not split: they land on the same data-parallel rank and in the same micro-batch (a
#: preference pair, whose loss needs both). The :class:`~drivetrain.api.batch.Batch`
#: partitioning methods honour it; the conformance kit checks an engine does.
SAMPLE_GROUP = "sample_group"
#: Per token, ``[layers, top_k]``: the experts a mixture-of-experts rollout routed the token to
#: in each MoE layer (-1 where nothing was recorded: the sequence's last token, padding), for an
#: engine with ``routing_replay`` to use instead of its own router's choice
#: (:mod:`drivetrain.api.routing`). Int16: 2 bytes per layer and pick.
ROUTED_EXPERTS = "routed_experts"

#: Columns holding one value per token (the rest hold one value per sample).
TOKEN_COLUMNS = frozenset(
    {
        INPUT_IDS,
        POSITION_IDS,
        LOSS_MASK,
        RESPONSE_MASK,
        LOG_PROBS,
        ENTROPY,
        VALUES,
        OLD_LOG_PROBS,
        REF_LOG_PROBS,
        ROLLOUT_LOG_PROBS,
        ADVANTAGES,
        RETURNS,
        REWARDS,
        TOKEN_WEIGHT_VERSION,
        ROUTED_EXPERTS,
    }
)

#: Each column's dtype, as torch names it (``str(tensor.dtype)`` without ``torch.``), in every
#: batch the trainer sends and every output an engine returns. ``loss_mask`` is a float (0.0 or
#: 1.0) because losses multiply by it; ids, counts and versions are int64; log-probs, entropies,
#: values, advantages, returns and rewards are float32 whatever the model's dtype.
DTYPES: Mapping[str, str] = MappingProxyType(
    {
        INPUT_IDS: "int64",
        POSITION_IDS: "int64",
        LOSS_MASK: "float32",
        RESPONSE_MASK: "int64",
        LOG_PROBS: "float32",
        ENTROPY: "float32",
        VALUES: "float32",
        OLD_LOG_PROBS: "float32",
        REF_LOG_PROBS: "float32",
        ROLLOUT_LOG_PROBS: "float32",
        ADVANTAGES: "float32",
        RETURNS: "float32",
        REWARDS: "float32",
        WEIGHT_VERSION: "int64",
        TOKEN_WEIGHT_VERSION: "int64",
        SHARED_PREFIX_LEN: "int64",
        SAMPLE_GROUP: "int64",
        ROUTED_EXPERTS: "int16",
    }
)
