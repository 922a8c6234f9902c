"""Structured outputs (vLLM V1's `structured_outputs`: json, regex, choice, grammar,
json_object) and the token rules beside them (logit_bias, allowed_token_ids, bad_words),
offline on a tiny random model: whatever the model would say, the output takes the shape
asked for, every way the engine steps (overlapped steps collect the step before early to
fill the mask), with n > 1, preemption and unconstrained requests in the same batch."""

from __future__ import annotations

import json
import random
import re

import pytest
from pydantic import BaseModel, Field

from pagedq import LLM, SamplingParams
from pagedq.core.messages import AddRequest
from pagedq.structured_outputs_params import StructuredOutputsParams


class Tag(BaseModel):
    label: str = Field(max_length=6)


class Item(BaseModel):
    """Bounded everywhere, so a random model's output ends within max_tokens."""

    name: str = Field(max_length=8)
    count: int = Field(ge=-5, le=999)
    done: bool
    tags: list[Tag] = Field(max_length=3)


SCHEMA = Item.model_json_schema()
REGEX = r"[0-9]{3}-[a-z]{2,4}"
CHOICES = ["yes", "no", "maybe later"]
# EBNF (xgrammar's, as llama.cpp's GBNF): a sum of up to three small numbers.
GRAMMAR = 'root ::= num (" + " num)? (" + " num)? " = ?"\nnum ::= [1-9] [0-9]?'


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return str(tiny_model_dir("llama"))


def check_shape(kind: str, text: str) -> None:
    if kind == "json":
        # strict=False: xgrammar's rule for a string with maxLength admits raw control
        # characters (as vLLM's output would hold them), which strict JSON parsers refuse.
        # The prompts and seeds are fixed: with some, the random model's byte-level tokens
        # fill a maxLength string with bytes that are not UTF-8, which the text shows as
        # one U+FFFD each, longer than maxLength (seen once in CI; xgrammar's count, not ours).
        Item.model_validate(json.loads(text, strict=False))
    elif kind == "json_object":
        assert isinstance(json.loads(text, strict=False), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){0,2} = \?", text), text


SHAPES = {
    "json": {"json": SCHEMA, "disable_any_whitespace": True},
    "json_object": {"json_object": True, "disable_any_whitespace": True},
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": GRAMMAR},
}


def test_every_kind_takes_its_shape_sampled_and_greedy_with_n(model, overlap):
    llm = LLM(model, dtype="float32", device="cpu", async_scheduling=overlap)
    rng = random.Random(0)  # fixed: see the note on byte-level strings in check_shape
    prompts, params, kinds = [], [], []
    for kind, shape in SHAPES.items():
        for temperature in (0.0, 1.0):
            prompts.append(" ".join(rng.choice(["a", "b", "cd", "xyz"]) for _ in range(rng.randint(1, 12))))
            params.append(SamplingParams(
                max_tokens=200, temperature=temperature, seed=rng.randrange(2**31), n=1 if temperature == 0 else 3,
                structured_outputs=shape,
            ))
            kinds.append(kind)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for kind, output in zip(kinds, outputs):
        for completion in output.outputs:
            if kind == "json_object" and completion.finish_reason == "length":
                # Any object may nest without end: a cut-off one is still an object's beginning.
                assert completion.text.startswith("{")
                continue
            assert completion.finish_reason == "stop", (kind, completion.text)
            check_shape(kind, completion.text)
    assert llm.llm_engine.engine_core.block_manager.num_free_blocks == llm.llm_engine.engine_core.block_manager.num_total_blocks


def test_constrained_requests_leave_their_neighbours_unchanged(model, overlap):
    """The mask applies to its own rows only: greedy unconstrained outputs are the same with
    constrained requests beside them as alone."""
    llm = LLM(model, dtype="float32", device="cpu", async_scheduling=overlap)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = ["one two three", "the quick brown fox", "z"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed_prompts = [p for prompt in prompts for p in (prompt, prompt)]
    mixed_params = [p for _ in prompts for p in (plain, SamplingParams(max_tokens=24, structured_outputs=SHAPES["regex"]))]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == alone
    for output in mixed[1::2]:
        check_shape("regex", output.outputs[0].text)


def test_grammar_survives_preemption(model):
    """A cache too small for everyone: sequences are preempted and recomputed mid-output,
    their matchers keep their place."""
    llm = LLM(model, dtype="float32", device="cpu", num_gpu_blocks_override=12, block_size=16, max_num_seqs=8)
    params = SamplingParams(max_tokens=150, temperature=1.0, structured_outputs=SHAPES["json"])
    outputs = llm.generate(["p"] * 8, params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.preemptions.recompute > 0
    for output in outputs:
        check_shape("json", output.outputs[0].text)


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(model, overlap):
    """The api refuses what does not convert; should one reach the core anyway (here built
    without the check), its request fails with the reason and the others finish."""
    llm = LLM(model, dtype="float32", device="cpu", async_scheduling=overlap)
    engine = llm.llm_engine
    broken = SamplingParams(max_tokens=8)
    broken.__dict__["structured_outputs"] = StructuredOutputsParams.model_construct(regex="a(b")
    engine.add_request("ok-1", "hello", SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("broken", "hello", broken)
    engine.add_request("ok-2", "hello", SamplingParams(max_tokens=40, structured_outputs=SHAPES["choice"]))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert "regex" in finished["broken"].error and "parenthesis" in finished["broken"].error
    assert finished["broken"].invalid_input  # its input's fault: a 4xx in the service
    assert len(finished["ok-1"].outputs[0].token_ids) == 8
    check_shape("choice", finished["ok-2"].outputs[0].text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constraints_that_leave_no_token_fail_their_request_alone_on_its_input(model, overlap, temperature):
    """A finished grammar allows only eos, which min_tokens holds back; allowed_token_ids of
    eos alone, within min_tokens: no token is allowed. The request fails on its own input
    (invalid_input: a 4xx in the service) without a token its rules forbid (greedy took
    token 0, sampling an id past the vocabulary); its neighbours finish."""
    llm = LLM(model, dtype="float32", device="cpu", async_scheduling=overlap)
    engine = llm.llm_engine
    eos = llm.get_tokenizer().eos_token_id
    engine.add_request("ok", "hello", SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=3))
    engine.add_request("grammar", "hello", SamplingParams(temperature=temperature, max_tokens=60, min_tokens=50,
                                                         structured_outputs=SHAPES["choice"]))
    engine.add_request("allowed", "hello", SamplingParams(temperature=temperature, max_tokens=8, min_tokens=3,
                                                         allowed_token_ids=[eos]))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    for name in ("grammar", "allowed"):
        assert finished[name].invalid_input and finished[name].error.startswith("no token is allowed"), finished[name]
    assert finished["allowed"].outputs[0].token_ids == []
    check_shape("choice", finished["grammar"].outputs[0].text)
    assert finished["ok"].error is None and len(finished["ok"].outputs[0].token_ids) == 12


def test_abort_while_the_grammar_compiles(model):
    llm = LLM(model, dtype="float32", device="cpu")
    engine = llm.llm_engine
    engine.add_request("a", "hello", SamplingParams(max_tokens=8, structured_outputs={"json": {"type": "array"}}))
    engine.abort_request(["a"])
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.engine_core.requests and not engine.engine_core._compiling
    assert llm.generate("x", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids


def test_the_grammar_ends_the_output_even_with_ignore_eos(model):
    """A finished grammar allows only its stop token; with ignore_eos the sequence still ends there ("stop")."""
    llm = LLM(model, dtype="float32", device="cpu")
    out = llm.generate("q", SamplingParams(max_tokens=50, ignore_eos=True, structured_outputs=SHAPES["choice"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 50
    check_shape("choice", out.text.removesuffix(llm.get_tokenizer().eos_token or ""))


def test_compiled_grammars_are_reused(model):
    llm = LLM(model, dtype="float32", device="cpu")
    core = llm.llm_engine.engine_core
    llm.generate(["a", "b"], SamplingParams(max_tokens=30, structured_outputs=SHAPES["json"]), use_tqdm=False)
    compiler = core._grammars
    first = compiler.submit(StructuredOutputsParams.model_validate(SHAPES["json"]))
    assert compiler.submit(StructuredOutputsParams.model_validate(SHAPES["json"])) is first
    assert len(compiler._compiled) == 1


def test_structured_outputs_cross_the_core_process_boundary(model):
    """AddRequest is msgpack-encoded for a core in its own process: the params survive the trip."""
    llm = LLM(model, dtype="float32", device="cpu", core_process=True)
    outputs = llm.generate(["a", "b"], [SamplingParams(max_tokens=60, structured_outputs=SHAPES["regex"]),
                                        SamplingParams(max_tokens=8, bad_words=["ab"], logit_bias={"7": 50.0})],
                           use_tqdm=False)
    check_shape("regex", outputs[0].outputs[0].text)
    assert all(t == 7 for t in outputs[1].outputs[0].token_ids)


# --- the token rules (vLLM V1's logits processors) ------------------------------------------


def test_logit_bias_allowed_token_ids_and_bad_words(model, overlap):
    llm = LLM(model, dtype="float32", device="cpu", async_scheduling=overlap)
    tokenizer = llm.get_tokenizer()
    rng = random.Random()
    favourite = rng.randrange(3, 500)
    allowed = rng.sample(range(3, 500), 5)
    out = llm.generate(
        ["a b c", "d e f", "g h i"],
        [
            SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, logit_bias={str(favourite): 100.0}),
            SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, allowed_token_ids=allowed),
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert out[0].outputs[0].token_ids == [favourite] * 12
    assert set(out[1].outputs[0].token_ids) <= set(allowed)
    # Ban a phrase of the greedy output (two tokens if one re-encodes to itself, else one):
    # it never appears, so the output changes.
    greedy = out[2].outputs[0].token_ids
    bad_words = llm.llm_engine.input_processor.bad_words_token_ids
    phrases = [list(p) for p in zip(greedy, greedy[1:])] + [[t] for t in greedy]
    for phrase in phrases:
        word = tokenizer.decode(phrase)
        sequences = bad_words(SamplingParams(bad_words=[word])) if word.strip() else []
        if any(s in phrases for s in sequences):
            break
    else:
        pytest.fail(f"no phrase of {greedy} re-encodes to itself")
    banned = llm.generate("g h i", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=[word]),
                          use_tqdm=False)[0].outputs[0].token_ids
    for sequence in sequences:
        n = len(sequence)
        assert all(banned[i:i + n] != sequence for i in range(len(banned) - n + 1)), (word, sequence, banned)
    assert banned != greedy


def test_long_token_rule_lists_cost_what_their_distinct_items_cost(model):
    """One request's lists are work at every step of every request in its batch: at most
    MAX_STRINGS stop strings and bad words (a 4xx naming the field past that), each allowed
    token id once, and a long bad-word list tokenized in one batch and de-duplicated in
    linear time (20,000 words took minutes, by list search, on the worker's loop)."""
    from pagedq.sampling_params import MAX_STRINGS

    for field in ("stop", "bad_words"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: [f"w{i}" for i in range(MAX_STRINGS + 1)]})
        assert len(getattr(SamplingParams(**{field: [f"w{i}" for i in range(MAX_STRINGS)]}), field)) == MAX_STRINGS
    assert SamplingParams(allowed_token_ids=[7, 3, 7] * 50_000 + [5]).allowed_token_ids == [7, 3, 5]
    llm = LLM(model, dtype="float32", device="cpu")
    tokenizer = llm.get_tokenizer()
    words = [f"w{i} x{i}" for i in range(MAX_STRINGS // 2)] * 2
    sequences = llm.llm_engine.input_processor.bad_words_token_ids(SamplingParams(bad_words=words))
    expected = []  # vLLM V1's two spellings of each word, each sequence once, in order
    for word in words:
        for spelling in (word, " " + word):
            ids = tokenizer.encode(spelling, add_special_tokens=False)
            if ids not in expected:
                expected.append(ids)
    assert sequences == expected


def test_token_rules_refuse_ids_outside_the_vocabulary(model):
    llm = LLM(model, dtype="float32", device="cpu")
    vocab = llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("a", SamplingParams(allowed_token_ids=[vocab]), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("a", SamplingParams(logit_bias={vocab + 3: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams.model_validate({"logit_bias": {"not-a-token": 1.0}})
    # vLLM clamps biases to OpenAI's range.
    assert SamplingParams.model_validate({"logit_bias": {"3": 1e9}}).logit_bias == {3: 100.0}


@pytest.mark.parametrize("shape, field", [
    ({"regex": "a(b"}, "structured_outputs.regex"),
    ({"json": '{"type": "bogus"}'}, "structured_outputs.json"),
    ({"grammar": "root ::= "}, "structured_outputs.grammar"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({}, "exactly one of"),
])
def test_a_shape_that_does_not_convert_is_refused_naming_it(shape, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        SamplingParams(structured_outputs=shape)


_DEEP_GROUPS = "(" * 30_000 + "a" + ")" * 30_000


@pytest.mark.parametrize("schema, why", [
    # Converted as is, this pattern overflowed xgrammar's C stack: the api died (SIGSEGV).
    ({"type": "string", "pattern": _DEEP_GROUPS}, "a pattern nests groups more than 1000 deep"),
    ({"type": "object", "patternProperties": {_DEEP_GROUPS: {}}}, "a pattern nests groups more than 1000 deep"),
    # As text it escaped the body's depth check, and took 3 s to convert at 400 levels, a minute at 1,000.
    ('{"type": "array", "items": ' * 400 + "{}" + "}" * 400, "the schema nests deeper than 64 levels"),
])
def test_a_schema_too_deep_to_convert_safely_is_refused_naming_it(schema, why):
    with pytest.raises(ValueError, match=re.escape(f"structured_outputs.json: {why}")):
        SamplingParams(structured_outputs={"json": schema})
    # Groups inside character classes and escaped parentheses are not groups.
    pattern = "[(]" * 2000 + r"\(" * 2000 + "(a(b))"
    assert SamplingParams(structured_outputs={"json": {"type": "string", "pattern": pattern}}).structured_outputs


@pytest.mark.parametrize("shape, why", [
    ({"choice": [f"c{i}" for i in range(1025)]}, "structured_outputs.choice"),
    ({"regex": "a|" * 8192 + "b"}, "structured_outputs.regex"),
    ({"grammar": 'root ::= "a"' + " | \"a\"" * 20_000}, "structured_outputs.grammar"),
    ({"json": {"enum": list(range(1025))}}, "structured_outputs.json: enum has 1025 entries, at most 1024"),
    ({"json": {"type": "object", "properties": {"a": {"anyOf": [{"const": i} for i in range(2000)]}}}},
     "structured_outputs.json: anyOf has 2000 entries"),
])
def test_a_shape_too_large_to_compile_quickly_is_refused_naming_it(shape, why):
    """Compile time grows faster than the alternatives: 20,000 choices held a core for 20 s
    and slowed every request beside them (40,000: a bystander waited 130 s)."""
    with pytest.raises(ValueError, match=re.escape(why)):
        SamplingParams(structured_outputs=shape)
    assert SamplingParams(structured_outputs={"choice": [f"c{i}" for i in range(1024)]}).structured_outputs


def test_add_request_message_carries_the_new_fields():
    from pagedq.core.messages import encoder, input_decoder

    params = SamplingParams(logit_bias={"3": 2.0}, structured_outputs=SHAPES["json"])
    decoded = input_decoder().decode(encoder().encode(AddRequest(1, [1, 2], params, 0.0, bad_words_token_ids=[[4, 5]])))
    assert decoded.params.logit_bias == {3: 2.0}
    assert decoded.params.structured_outputs.cache_key() == params.structured_outputs.cache_key()
    assert decoded.bad_words_token_ids == [[4, 5]]
