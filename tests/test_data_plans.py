"""``plans.prompt_ids``: the one function deciding what the target is conditioned on before its
first answer (distill, bench, tune, generate), for chat-template and raw tokenizers."""

import copy

import pytest

from headway.data.chat import conversation_pieces
from headway.data.errors import ChatTemplateError, DataError
from headway.data.plans import describe_format, make_plan, prompt_ids
from headway.data.samples import Sample
from headway.testing import tiny_tokenizer

# Renders an assistant message with a prefix the generation prompt lacks (like Qwen3's empty
# think block in non-thinking mode), so apply_chat_template(add_generation_prompt=True) differs
# from the text distill puts before an answer.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>\n<think></think>"
            "{{ m.content }}{{ eos_token }}\n{% else %}<|{{ m.role }}|>\n{{ m.content }}{{ eos_token }}\n{% endif %}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
PROMPT = "def add(a, b):\n    return a + b\n"
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop"},
        {"role": "assistant", "content": "OLD"}, {"role": "user", "content": "Now a function"}]


@pytest.fixture
def chat_tok():
    t = copy.deepcopy(tiny_tokenizer())  # the cached instance must not change
    t.chat_template = TEMPLATE
    return t


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_plain_prompt_on_a_chat_target_is_the_user_message_distill_answers(chat_tok):
    sample = Sample("p", prompt=PROMPT)
    got, used = prompt_ids(sample, chat_tok, TEMPLATE)
    assert used == "chat"
    assert got == make_plan(0, sample, chat_tok, TEMPLATE, "auto", "t").piece_ids[0]
    piece = conversation_pieces(chat_tok, [{"role": "user", "content": PROMPT}], TEMPLATE)[0]
    assert piece == f"<|bos|><|user|>\n{PROMPT}<|eos|>\n<|assistant|>\n<think></think>"
    assert got == ids(chat_tok, piece)
    assert got != chat_tok(PROMPT)["input_ids"] and got != chat_tok(PROMPT.rstrip())["input_ids"]  # not raw


def test_messages_give_the_text_before_the_first_answer(chat_tok):
    sample = Sample("c", messages=CONV)
    got, used = prompt_ids(sample, chat_tok, TEMPLATE)
    assert used == "chat"
    assert got == make_plan(0, sample, chat_tok, TEMPLATE, "auto", "t").piece_ids[0]
    assert chat_tok.decode(got) == ("<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nWrite a loop<|eos|>\n"
                                    "<|assistant|>\n<think></think>")
    generation_prompt = chat_tok.apply_chat_template(CONV[:2], add_generation_prompt=True, tokenize=True)
    generation_prompt = generation_prompt["input_ids"] if hasattr(generation_prompt, "keys") else generation_prompt
    assert got != list(generation_prompt)  # what bench used to condition on


def test_raw_format_and_raw_targets_tokenise_the_prompt_as_it_is(chat_tok):
    sample = Sample("p", prompt=PROMPT)
    raw = chat_tok(PROMPT)["input_ids"]  # special tokens included, trailing whitespace kept, as distill does
    assert prompt_ids(sample, chat_tok, TEMPLATE, "raw") == (raw, "raw")
    assert prompt_ids(sample, tiny_tokenizer(), None) == (raw, "raw")
    assert prompt_ids(sample, tiny_tokenizer(), None)[0] == make_plan(0, sample, tiny_tokenizer(), None, "auto",
                                                                      "t").piece_ids[0]


def test_chat_without_a_template_and_bad_formats_are_refused():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        prompt_ids(Sample("p", prompt=PROMPT), tiny_tokenizer(), None, "chat", "tiny")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        prompt_ids(Sample("c", messages=CONV), tiny_tokenizer(), None, "raw", "tiny")  # messages need one
    with pytest.raises(DataError, match="prompt_format must be one of"):
        prompt_ids(Sample("p", prompt=PROMPT), tiny_tokenizer(), None, "jinja")


def test_describe_format():
    assert describe_format(["raw", "raw"]) == "raw"
    assert describe_format(["chat"]) == "chat (template of the target)"
    assert describe_format(["chat"], "t.jinja") == "chat (template from t.jinja)"
    assert describe_format(["chat", "raw", "chat"]) == "mixed: chat (template of the target) for 2, raw for 1"


def test_tune_and_generate_use_the_same_ids(chat_tok, tmp_path):
    import json

    from headway.decode.cli import prompt_token_ids
    from headway.decode.speculator import DecodeError
    from headway.bench.tune import TuneConfig, calibration_prompts

    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": PROMPT}) + "\n" + json.dumps({"messages": CONV}) + "\n")
    want = [prompt_ids(Sample("p", prompt=PROMPT), chat_tok, TEMPLATE)[0],
            prompt_ids(Sample("c", messages=CONV), chat_tok, TEMPLATE)[0]]
    assert calibration_prompts(TuneConfig(target="t", heads="h", prompts=str(src)), chat_tok) == want
    raw = calibration_prompts(TuneConfig(target="t", heads="h", prompts=str(src), prompt_format="raw"), chat_tok)
    assert raw == [chat_tok(PROMPT)["input_ids"], want[1]]
    assert prompt_token_ids(chat_tok, PROMPT, True, "t") == want[0]
    assert prompt_token_ids(chat_tok, PROMPT, False, "t") == chat_tok(PROMPT)["input_ids"]
    with pytest.raises(DecodeError, match="--chat needs a chat template"):
        prompt_token_ids(tiny_tokenizer(), PROMPT, True, "tiny")


def test_demo_code_prompts_stay_stripped_of_trailing_whitespace():
    """The demo BPE merges newline + indent; the demo source strips prompts, and prompt_ids keeps them so."""
    from headway.data.sources import read_samples

    tok = tiny_tokenizer()
    for s in read_samples("demo:heldout", tokenizer=tok, limit=4, prompt_tokens=32).samples:
        got, used = prompt_ids(s, tok, None)
        assert used == "raw" and got == tok(s.prompt)["input_ids"]
        assert s.prompt == s.prompt.rstrip() and tok.decode(got) == tok.decode(got).rstrip()
