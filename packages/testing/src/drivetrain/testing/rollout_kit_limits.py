"""The rollout kit's checks of what ends, filters or refuses a request: ``max_new_tokens``,
stop token ids, stop strings, EOS, top-k and top-p, prompts past the context, unknown
weight names, chat-message prompts, ``pause_generation(abort=True)`` and sleep/wake.

Each compares a request with the undisturbed greedy (or seeded) run of the same prompt, so a
failure names the parameter the rollout ignored and where its output went wrong."""

from __future__ import annotations

from drivetrain.api.requests import Request
from drivetrain.api.rollout import Completion, FinishReason, Prompt, Rollout, SamplingParams
from drivetrain.runtime.collector import Collector
from drivetrain.testing.rollout_harness import (
    RolloutHarness,
    assert_log_probs,
    deadline,
    drain,
    greedy,
    requests_for,
    run,
    with_rollout,
)

#: tokens of the undisturbed runs the stop checks cut
LENGTH = 24


def _expect_cut(
    c: Completion, reference: tuple[int, ...], k: int, reason: FinishReason, what: str
) -> None:
    """``c`` is ``reference`` up to and including its token ``k``, ended with ``reason``."""
    n = len(c.token_ids)
    if c.token_ids == reference[:k]:
        raise AssertionError(
            f"{what}: the request ended at the token before it ({k} tokens) "
            "and dropped it: the token that ends a request stays in "
            "token_ids"
        )
    if n > k + 1 and c.token_ids[: k + 1] == reference[: k + 1]:
        raise AssertionError(f"{what}: the request ran past it, to {n} tokens: it is ignored")
    if c.token_ids != reference[: k + 1]:
        raise AssertionError(f"{what}: tokens {c.token_ids}, wanted {reference[: k + 1]}")
    if c.finish_reason is not reason:
        raise AssertionError(f"{what}: finished with {c.finish_reason}, wanted {reason}")


def _first_new_text(h: RolloutHarness, tokens: tuple[int, ...]) -> tuple[int, str] | None:
    """A position ``k >= 1`` and a stop string that the text of ``tokens[: k + 1]`` holds and
    the text of ``tokens[:k]`` does not (the latest such ``k``, the shortest string)."""
    for k in range(len(tokens) - 2, 0, -1):
        before, text = h.decode(tokens[:k]), h.decode(tokens[: k + 1])
        for size in range(1, len(text) + 1):
            stop = text[-size:]
            if "\ufffd" not in stop and stop.strip() and stop not in before:
                return k, stop
    return None


def check_stop_conditions(h: RolloutHarness) -> None:
    """``max_new_tokens`` ends a request after exactly that many tokens (``length``); a stop
    token id, a stop string and EOS (unless ``ignore_eos``) end it at the token that completes
    them, which stays in ``token_ids`` (``stop``); a stop string is matched on the generated
    text only, cut at a token boundary."""

    def check(rollout: Rollout) -> None:
        prompts = h.prompts()
        undisturbed = run(h, rollout, requests_for(h, greedy(LENGTH), "u-"))
        refs = [c.token_ids for c in undisturbed]
        for i, budget in enumerate((1, 3, 7)):
            params = greedy(budget)
            c = run(h, rollout, [Request(f"budget-{budget}", prompts[i], params, i)])[0]
            if c.token_ids != refs[i][:budget] or c.finish_reason is not FinishReason.LENGTH:
                raise AssertionError(
                    f"max_new_tokens={budget} gave {len(c.token_ids)} tokens ending with "
                    f"{c.finish_reason}, wanted the first {budget} of the greedy run and length"
                    + (": max_new_tokens is ignored" if len(c.token_ids) > budget else "")
                )
        _check_stops(h, rollout)
        _check_eos(h, rollout)

    with_rollout(h, check)


def _seeded(h: RolloutHarness, prefix: str, **fields: object) -> list[Request]:
    """Two seeded sampled requests per harness prompt (temperature 1, ``LENGTH`` tokens, EOS
    ignored unless ``fields`` say otherwise): a seeded request repeats its tokens whatever runs
    beside it and whatever ends it, so each is its own undisturbed reference."""
    prompts = h.prompts()
    return [
        Request(
            f"{prefix}{i}",
            prompts[i % len(prompts)],
            SamplingParams(
                **{  # type: ignore[arg-type]
                    "temperature": 1.0,
                    "max_new_tokens": LENGTH,
                    "ignore_eos": True,
                    "seed": 1000 + i,
                    **fields,
                }
            ),
            i,
        )
        for i in range(2 * len(prompts))
    ]


def _check_stops(h: RolloutHarness, rollout: Rollout) -> None:
    """Stop token ids and stop strings cut seeded requests where their undisturbed runs
    first sample (or complete the text of) them."""
    refs = [c.token_ids for c in run(h, rollout, _seeded(h, "free-"))]
    for i, ref in enumerate(refs[:4]):
        k = max(j for j in range(len(ref)) if ref[j] not in ref[:j])
        c = run(h, rollout, [_seeded(h, "stop-id-", stop_token_ids=(ref[k],))[i]])[0]
        what = f"stop_token_ids=({ref[k]},) first sampled at position {k} of request {i}"
        _expect_cut(c, ref, k, FinishReason.STOP, what)
    cuts = [(i, found) for i, ref in enumerate(refs) if (found := _first_new_text(h, ref))]
    if not cuts:
        first = h.decode(refs[0])
        raise AssertionError(
            f"no seeded request's text gives a stop string to check (the "
            f"first: {first!r}): give prompts with other outputs"
        )
    for i, (k, stop) in cuts[:4]:
        c = run(h, rollout, [_seeded(h, "stop-text-", stop=(stop,))[i]])[0]
        what = f"stop string {stop!r}, completed by token {k} of seeded request {i}"
        _expect_cut(c, refs[i], k, FinishReason.STOP, what)


def _check_eos(h: RolloutHarness, rollout: Rollout) -> None:
    """Seeded requests with EOS honoured: each whose undisturbed run sampled EOS ends there,
    EOS kept."""
    eos = h.eos_token_id()
    if eos is None:
        return
    free = run(h, rollout, _seeded(h, "eos-free-"))
    hits = [(c, c.token_ids.index(eos)) for c in free if eos in c.token_ids]
    if not hits:
        raise AssertionError(
            f"EOS (token {eos}) never came up in {len(free)} seeded requests of {LENGTH} tokens "
            "at temperature 1, so the kit cannot check that it ends a request: give prompts "
            "after which the model may end"
        )
    ended = run(h, rollout, _seeded(h, "eos-", ignore_eos=False))
    for c, k in hits:
        what = f"EOS (token {eos}) sampled at position {k} of seeded request {c.prompt_index}"
        _expect_cut(ended[c.prompt_index], c.token_ids, k, FinishReason.STOP, what)


def check_sampling_filters(h: RolloutHarness) -> None:
    """Top-k and top-p filter what is sampled, and the log-probs reported are those of the
    filtered, renormalised distribution: at temperature 1, ``top_k=1`` and a ``top_p`` below
    the most likely token's mass both sample the greedy tokens, each with log-prob 0."""

    def check(rollout: Rollout) -> None:
        refs = [c.token_ids for c in run(h, rollout, requests_for(h, greedy(16), "g-"))]
        for name, filters in (("top_k=1", {"top_k": 1}), ("top_p=0.001", {"top_p": 0.001})):
            requests = [
                Request(
                    f"{name}-{i}",
                    p,
                    SamplingParams(
                        temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=50 + i, **filters
                    ),
                    i,
                )
                for i, p in enumerate(h.prompts())
            ]
            for c, ref in zip(run(h, rollout, requests), refs, strict=True):
                if c.token_ids != ref:
                    k = next(j for j in range(len(ref)) if c.token_ids[j : j + 1] != ref[j : j + 1])
                    got = c.token_ids[k : k + 1] or "nothing"
                    raise AssertionError(
                        f"{name} at temperature 1 sampled {got} at position "
                        f"{k} of prompt {c.prompt_index} where only the most likely, "
                        f"{ref[k]}, is left: {name.split('=')[0]} is ignored"
                    )
                worst = max(abs(x) for x in c.log_probs)
                if not worst <= h.log_prob_tolerance:
                    raise AssertionError(
                        f"{name}: log-probs up to {-worst:.3g} for tokens that were the only "
                        "ones left (log-prob 0): report the filtered, renormalised "
                        "distribution's log-probs, as the trainer recomputes them"
                    )

    with_rollout(h, check)


def check_refusals(h: RolloutHarness) -> None:
    """A prompt past the context is refused at ``submit`` and by ``generate`` (``ValueError``)
    and nothing of the call runs; a weight update whose first name is one the model lacks
    raises (``KeyError``) and leaves version 0 serving (or refusing until a whole update);
    chat-message prompts give the tokens of their template's ids, or are refused where the
    rollout takes token ids only."""

    def check(rollout: Rollout) -> None:
        prompt = h.prompts()[0]
        before = run(h, rollout, [Request("before", prompt, greedy(8))])[0]
        context = rollout.config.max_model_len
        too_long = (prompt * (context // len(prompt) + 1))[:context]
        fine = Request("fine", prompt, greedy(8))
        try:
            rollout.submit([fine, Request("too-long", too_long, greedy(8))])
        except ValueError:
            pass
        else:
            raise AssertionError(
                f"a {context}-token prompt plus 8 new tokens (max_model_len "
                f"{context}) was accepted at submit"
            )
        try:
            rollout.generate([Prompt(token_ids=too_long)], greedy(8))
        except ValueError:
            pass
        else:
            raise AssertionError(f"generate accepted a {context}-token prompt plus 8 new tokens")
        if run(h, rollout, [fine])[0].token_ids != before.token_ids:  # its id is free: not run
            raise AssertionError("a request refused with an over-long one changed its output")
        _check_unknown_weight_name(h, rollout, before)
        _check_messages(h, rollout)

    with_rollout(h, check)


def _check_unknown_weight_name(h: RolloutHarness, rollout: Rollout, before: Completion) -> None:
    """An update whose first weight the model lacks raises ``KeyError``; version 0 serves on,
    or the rollout refuses until a whole update lands."""
    prompt = before.prompt_ids
    name, value = h.changed_weights()[0]
    try:
        rollout.update_weights([("no.such.weight", value), (name, value)], version=3)
    except KeyError:
        pass
    else:
        raise AssertionError("an update naming 'no.such.weight' was accepted")
    if rollout.weight_version != 0:
        raise AssertionError(
            f"version {rollout.weight_version} after an update refused for an unknown weight name"
        )
    try:
        after = run(h, rollout, [Request("after-bad-name", prompt, greedy(8))])[0]
    except RuntimeError:  # refusing until a whole update lands is safe too
        rollout.update_weights(h.changed_weights(), version=4)
    else:
        if after.token_ids != before.token_ids or set(after.token_versions) != {0}:
            raise AssertionError(
                "after an update refused for an unknown weight name the "
                "rollout served other weights without refusing"
            )


def _check_messages(h: RolloutHarness, rollout: Rollout) -> None:
    messages = ({"role": "user", "content": "What is 2 + 3?"},)
    ids = h.chat_prompt_ids(messages)
    if ids is None:
        try:
            rollout.generate([Prompt(messages=messages)], greedy(4))
        except ValueError:
            return
        raise AssertionError(
            "a message prompt was accepted, but the harness says the rollout "
            "takes token ids only (chat_prompt_ids returns None)"
        )
    chat = rollout.generate([Prompt(messages=messages)], greedy(8))[0]
    plain = rollout.generate([Prompt(token_ids=ids)], greedy(8))[0]
    if chat.prompt_ids != ids or chat.token_ids != plain.token_ids:
        raise AssertionError(
            f"a message prompt ran as {chat.prompt_ids}, not as its chat template's ids {ids}"
        )


def check_pause_abort(h: RolloutHarness) -> None:
    """``pause_generation(abort=True)`` while requests stream aborts the running ones (each
    keeps its generated prefix and ends with ``abort``; the count is returned); nothing else
    runs, a request submitted meanwhile included, until ``resume_generation``, after which the
    held ones run whole."""

    def check(rollout: Rollout) -> None:
        undisturbed = run(h, rollout, requests_for(h, greedy(LENGTH), "u-"))
        late = Request("while-paused", h.prompts()[0], greedy(4), 0)
        requests = [*requests_for(h, greedy(LENGTH), "p-"), late]
        collector = Collector()
        for r in requests:
            collector.track(r)
        rollout.submit(requests[:-1])
        started: set[str] = set()
        overdue = deadline(h)
        while len(started) < 2:  # stop while requests are running
            overdue("tokens of 2 requests")
            chunks = rollout.poll(0.05)
            collector.add(chunks)
            started |= {c.request_id for c in chunks if c.token_ids and not c.finished}
            if all(collector.finished(r.request_id) for r in requests[:-1]):
                raise AssertionError(
                    "every request ended before two had streamed tokens, so none could be "
                    "paused part-way: poll must return the tokens sampled since the last poll"
                )
        aborted = rollout.pause_generation(abort=True)
        rollout.submit(requests[-1:])
        stopped = _poll_while_paused(h, rollout, collector, started)
        if not started <= stopped:
            raise AssertionError(
                "pause_generation(abort=True) let running requests go on: "
                f"{sorted(started - stopped)}"
            )
        if aborted != len(stopped):
            raise AssertionError(
                f"pause_generation(abort=True) returned {aborted}, but "
                f"{len(stopped)} requests ended with abort"
            )
        rollout.resume_generation()
        drain(rollout, collector, h)
        for r, ref in zip(requests, undisturbed, strict=False):
            c = collector.completion(r.request_id)
            cut = r.request_id in stopped
            if c.token_ids != (ref.token_ids[: len(c.token_ids)] if cut else ref.token_ids):
                raise AssertionError(
                    f"{r.request_id}: tokens {c.token_ids} are not "
                    f"{'a prefix of ' * cut}{ref.token_ids}"
                )
            assert_log_probs(h, c, 0, False, r.request_id)
        if len(collector.completion("while-paused").token_ids) != 4:
            raise AssertionError("a request held by the pause did not run whole after resume")

    with_rollout(h, check)


def _poll_while_paused(
    h: RolloutHarness, rollout: Rollout, collector: Collector, started: set[str]
) -> set[str]:
    """Poll a paused rollout until the requests seen running have ended, then 3 more times:
    nothing may come but aborted requests' last chunks. Returns the aborted requests."""
    overdue, extra, stopped = deadline(h), 3, set()
    while extra:
        overdue("the last chunks of the requests the pause aborted")
        chunks = rollout.poll(0.05)
        ran = [
            c
            for c in chunks
            if c.request_id not in started
            and not (c.finished and c.finish_reason is FinishReason.ABORT)
        ]
        if ran:
            raise AssertionError(f"a paused rollout generated {ran[0]}")
        collector.add(chunks)
        stopped |= {c.request_id for c in chunks if c.finish_reason is FinishReason.ABORT}
        ended = {c.request_id for c in chunks if c.finished}
        started_left = started - stopped - ended
        if not started_left:
            extra -= 1
    return stopped


def check_sleep(h: RolloutHarness) -> None:
    """Sleep and wake as colocated training uses them: ``sleep(1)`` then a whole wake keeps
    the weights; ``sleep(2)``, waking the weights, an update and waking the KV cache serve the
    update (a rollout that frees nothing passes trivially)."""

    def check(rollout: Rollout) -> None:
        prompt = h.prompts()[0]
        before = run(h, rollout, [Request("before", prompt, greedy(12))])[0]
        rollout.sleep(1)
        rollout.wake_up()
        again = run(h, rollout, [Request("after-sleep-1", prompt, greedy(12))])[0]
        if again.token_ids != before.token_ids:
            raise AssertionError("sleep(1) and wake_up() changed the greedy tokens")
        rollout.sleep(2)
        rollout.wake_up(("weights",))
        rollout.update_weights(h.changed_weights(), version=2)
        rollout.wake_up(("kv_cache",))
        after = run(h, rollout, [Request("after-sleep-2", prompt, greedy(12))])[0]
        if set(after.token_versions) != {2}:
            raise AssertionError(
                "after sleep(2), update 2 and wake_up, a request reports "
                f"versions {sorted(set(after.token_versions))}"
            )
        if after.token_ids == before.token_ids:
            raise AssertionError(
                "after sleep(2), an update and wake_up, the rollout served the old weights: a "
                "level-2 sleep must take the weights re-sent to it"
            )
        assert_log_probs(h, after, 0, True, "greedy after sleep(2) and an update")

    with_rollout(h, check)
