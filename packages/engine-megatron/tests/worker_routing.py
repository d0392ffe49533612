"""torchrun worker: routing replay in the megatron engine, layout after layout in one process
(importing megatron-core costs ~6 s per process).

argv: OUT_DIR MOE_DIR DENSE_DIR ROUTING_PT LAYOUTS_JSON. ``ROUTING_PT`` holds the HF model's own
routing of ``parity_data.training_batch()`` as the padded column ``[samples, width, layers,
top_k]`` (-1 on padding); ``shifted`` is it with every expert index plus one (mod experts): a
routing far from the model's own, so a replay that went wrong shows in every number. Each layout
{"name", "overrides", "recompute"} reports, on its output ranks (the rest report None):

- ``samples``: the batch's samples this rank's data-parallel shard holds, in shard order;
- ``own``/``base``: ``infer``'s routed experts and log-probs, no routing given;
- ``same``/``same_routed``: ``own`` replayed; ``planted``: ``own`` with one wrong expert at one
  token; ``moved``/``moved_routed``: it replayed; ``sparse``: log-probs replaying only that
  token's (every other row -1: the router's own choice), ``sparse_routed`` the experts that
  used, and ``sparse_again`` log-probs replaying those;
- ``shifted``: log-probs replaying ``shifted``;
- ``train``: ``forward_backward`` loss and gradient norm (no step) on the shard alone
  (``plain``), replaying the HF routing (``own``) and ``shifted``, and how many samples' routed
  experts in the loss function differed from what the step should have used (``mismatched``).

Under pipeline parallel the routed experts output is refused (``refused``); replay still runs.
``out_of_range``: the refusal of an expert index past the last expert. A dense model's
refusals land in the report under ``dense``.
"""

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from drivetrain.api import MicroBatchConfig, OutputSpec
from drivetrain.api.columns import INPUT_IDS, LOG_PROBS, ROUTED_EXPERTS
from drivetrain.engine.megatron.engine import MegatronEngine
from drivetrain.testing import token_mean_nll
from megatron_harness import MegatronHarness
from megatron_launch import single_thread, write_result
from parity_data import training_batch

EXPERTS = 4
ROW, POS = 1, 4  # the planted token: sample 1 of the shard, position 4, layer 0


def make_engine(model_dir, overrides, recompute=False):
    config = MegatronHarness(model_dir, overrides=overrides).config(
        MicroBatchConfig(micro_batch_size=2)  # several micro-batches: the recompute FIFO
    )
    if recompute:
        model = dataclasses.replace(config.model, gradient_checkpointing=True)
        config = dataclasses.replace(config, model=model)
    engine = MegatronEngine(config)
    engine.initialize()
    return engine


def shared(engine, value):
    """The output rank's ``value`` on every rank of its data-parallel rank (tensor- and
    pipeline-parallel peers must be given the same column)."""
    everyone = [None] * dist.get_world_size()
    p = engine.parallel
    dist.all_gather_object(everyone, (p.dp_rank, p.is_output_rank, value))
    return next(v for dp, out, v in everyone if out and dp == p.dp_rank)


def infer(engine, shard, column=None, routed=True):
    if column is not None:
        shard = shard.with_columns(**{ROUTED_EXPERTS: column})
    out = engine.infer(shard, OutputSpec(routed_experts=routed))
    return shared(engine, None if out is None else dict(out.columns))


def refusal(run):
    """The one-line error ``run()`` raised, or None."""
    try:
        run()
    except Exception as error:  # the message is the result
        return f"{type(error).__name__}: {error}"
    return None


def by_sample(batch, column):
    """sample's tokens -> its routing rows (the training batch's sequences are distinct)."""
    ids = batch[INPUT_IDS]
    return {tuple(ids[i, :n].tolist()): column[i, :n] for i, n in enumerate(batch.seq_lens)}


def step(engine, shard, expected, routed):
    """One ``forward_backward``, its gradient norm, then the gradients dropped (no update)."""
    mismatched = []

    def loss_fn(outputs, micro, ctx):
        if routed:
            got = by_sample(micro, outputs[ROUTED_EXPERTS])
            mismatched.extend(not torch.equal(v, expected[k]) for k, v in got.items())
        return token_mean_nll(outputs, micro, ctx)

    with engine.train_mode():
        engine.optimizer_zero_grad()
        spec = OutputSpec(routed_experts=routed)
        loss = engine.forward_backward(shard, loss_fn, outputs=spec).loss
        engine.optimizer.prepare_grads()
        norm = float(engine.optimizer.get_grad_norm())
        engine.optimizer_zero_grad()
    return {"loss": loss, "norm": norm, "mismatched": sum(mismatched)}


def plant(own):
    """``own`` with layer 0's first pick of one token replaced by an expert it did not pick."""
    planted = own.clone()
    picks = planted[ROW, POS, 0].tolist()
    planted[ROW, POS, 0, 0] = next(e for e in range(EXPERTS) if e not in picks)
    return planted


def run_layout(layout, moe_dir, routing):
    engine = make_engine(moe_dir, layout["overrides"], layout.get("recompute", False))
    try:
        p = engine.parallel
        batch = MegatronHarness(moe_dir).make_batch(*training_batch())
        samples = batch.dp_shards(p.dp_size)[p.dp_rank]
        shard = engine.parallel.shard_of(batch.with_columns(**{ROUTED_EXPERTS: routing}))
        hf, plain = shard[ROUTED_EXPERTS], shard.drop(ROUTED_EXPERTS)
        shifted = torch.where(hf >= 0, (hf + 1) % EXPERTS, hf).to(torch.int16)
        piped = layout["overrides"].get("pipeline_parallel", 1) > 1
        report = {"samples": samples}
        with engine.eval_mode():
            too_far = hf.clamp(min=EXPERTS)
            report["out_of_range"] = refusal(lambda: infer(engine, plain, too_far, routed=False))
            if piped:
                report["refused"] = refusal(lambda: infer(engine, plain))
                report["base"] = infer(engine, plain, routed=False)[LOG_PROBS]
            else:
                own = infer(engine, plain)
                report["own"], report["base"] = own[ROUTED_EXPERTS], own[LOG_PROBS]
                same = infer(engine, plain, own[ROUTED_EXPERTS])
                report["same"], report["same_routed"] = same[LOG_PROBS], same[ROUTED_EXPERTS]
                planted = plant(own[ROUTED_EXPERTS])
                moved = infer(engine, plain, planted)
                report["planted"] = planted
                report["moved"], report["moved_routed"] = moved[LOG_PROBS], moved[ROUTED_EXPERTS]
                sparse = torch.full_like(planted, -1)
                sparse[ROW, POS] = planted[ROW, POS]
                sparse = infer(engine, plain, sparse)
                report["sparse"], report["sparse_routed"] = (
                    sparse[LOG_PROBS],
                    sparse[ROUTED_EXPERTS],
                )
                report["sparse_again"] = infer(engine, plain, sparse[ROUTED_EXPERTS])[LOG_PROBS]
            report["shifted"] = infer(engine, plain, shifted, routed=not piped)[LOG_PROBS]
        routed = not piped
        report["train"] = {
            "plain": step(engine, plain, by_sample(shard, hf), routed),
            "own": step(engine, shard, by_sample(shard, hf), routed),
            "shifted": step(
                engine, plain.with_columns(**{ROUTED_EXPERTS: shifted}), by_sample(shard, shifted),
                routed,
            ),
        }  # fmt: skip
        return report if p.is_output_rank else None
    finally:
        engine.close()


def run_dense(dense_dir):
    """The refusals of a model without routers: asked for its routing, or given one."""
    engine = make_engine(dense_dir, {})
    batch = MegatronHarness(dense_dir).make_batch(*training_batch())
    column = torch.zeros(*batch[INPUT_IDS].shape, 2, 2, dtype=torch.int16)
    try:
        with engine.eval_mode():
            return [
                refusal(lambda: engine.infer(batch, OutputSpec(routed_experts=True))),
                refusal(
                    lambda: engine.infer(
                        batch.with_columns(**{ROUTED_EXPERTS: column}), OutputSpec()
                    )
                ),
            ]
    finally:
        engine.close()


if __name__ == "__main__":
    single_thread()
    out_dir, moe_dir, dense_dir, routing_pt = sys.argv[1:5]
    routing = torch.load(routing_pt, weights_only=True)
    layouts = json.loads(sys.argv[5])
    results = {layout["name"]: run_layout(layout, moe_dir, routing) for layout in layouts}
    results["dense"] = run_dense(dense_dir)
    write_result(out_dir, results)
    dist.destroy_process_group()
