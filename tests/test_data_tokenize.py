"""Assistant-only loss masks for data that already has answers, for two chat templates.

ChatML-like with ``{% generation %}`` markers (``return_assistant_tokens_mask``) and a
Zephyr-like template without markers (spans found by rendering prefixes). Expected token
spans are built by hand from the template's pieces.
"""

import copy
import json

import pytest

from headway.data.chat import assistant_mask, conversation_pieces, has_generation_markers, load_chat_template
from headway.data.distill import load_distilled
from headway.data.encode import TokenizeConfig, tokenize_dataset, tokenize_sample
from headway.data.errors import BadRowError, ChatTemplateError
from headway.data.samples import Sample
from headway.testing import tiny_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
          "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
          "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ZEPHYR = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content | trim }}{{ eos_token }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there!"}, {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "See you."}]


@pytest.fixture
def tok():
    t = copy.deepcopy(tiny_tokenizer())  # the cached instance must not change
    t.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    return t


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def by_hand(tok, pieces):
    """(ids, mask) from (text, is_answer) pieces, each tokenised on its own."""
    out_ids, out_mask = [], []
    for text, answer in pieces:
        t = ids(tok, text)
        out_ids += t
        out_mask += [int(answer)] * len(t)
    return out_ids, out_mask


def masked_spans(tok, input_ids, mask):
    spans, cur = [], []
    for t, m in zip(input_ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur)), cur.clear()
    return spans + ([tok.decode(cur)] if cur else [])


def test_chatml_with_generation_markers(tok):
    assert has_generation_markers(CHATML)
    got = assistant_mask(tok, MESSAGES, CHATML)
    want = by_hand(tok, [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                          "<|im_start|>assistant\n", 0), ("Hello there!<|im_end|>", 1),
                         ("\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n", 0),
                         ("See you.<|im_end|>", 1), ("\n", 0)])
    assert got == want
    assert masked_spans(tok, *got) == ["Hello there!<|im_end|>", "See you.<|im_end|>"]


def test_zephyr_without_markers_by_prefix_rendering(tok):
    assert not has_generation_markers(ZEPHYR)
    got = assistant_mask(tok, MESSAGES, ZEPHYR)
    want = by_hand(tok, [("<|system|>\nBe brief.<|eos|>\n<|user|>\nHi<|eos|>\n<|assistant|>\n", 0),
                         ("Hello there!<|eos|>", 1), ("\n<|user|>\nBye<|eos|>\n<|assistant|>\n", 0),
                         ("See you.<|eos|>", 1), ("\n", 0)])
    assert got == want
    assert masked_spans(tok, *got) == ["Hello there!<|eos|>", "See you.<|eos|>"]


def test_prefix_rendering_handles_trimmed_content(tok):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  padded answer \n"}]
    got = assistant_mask(tok, msgs, ZEPHYR)
    assert masked_spans(tok, *got) == ["padded answer<|eos|>"]


def test_both_methods_agree_on_equivalent_templates(tok):
    no_markers = CHATML.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert assistant_mask(tok, MESSAGES, no_markers) == assistant_mask(tok, MESSAGES, CHATML)


def test_plain_prompt_and_completion(tok):
    s = Sample("0", prompt="x = ", completion="1")
    got = tokenize_sample(tok, s, None, "auto")
    assert got == (ids(tok, "x = ") + ids(tok, "1") + [tok.eos_token_id],
                   [0] * len(ids(tok, "x = ")) + [1] * (len(ids(tok, "1")) + 1))


def test_plain_prompt_becomes_a_chat_turn_with_a_template(tok):
    got = tokenize_sample(tok, Sample("0", prompt="Hi", completion="Hello there!"), ZEPHYR, "auto")
    assert masked_spans(tok, *got) == ["Hello there!<|eos|>"]


def test_conversation_pieces_regenerate_every_assistant_turn(tok):
    pieces = conversation_pieces(tok, MESSAGES[:4], ZEPHYR)  # ends with a user turn: one more answer
    assert pieces == ["<|system|>\nBe brief.<|eos|>\n<|user|>\nHi<|eos|>\n<|assistant|>\n",
                      "<|eos|>\n<|user|>\nBye<|eos|>\n<|assistant|>\n"]


def test_messages_without_a_template_suggest_chat_template(tok):
    with pytest.raises(ChatTemplateError, match="--chat-template"):
        tokenize_sample(tok, Sample("r1", messages=MESSAGES), None)


def test_rows_without_answers_are_bad_rows(tok):
    with pytest.raises(BadRowError, match="no answer"):
        tokenize_sample(tok, Sample("r1", prompt="just a prompt"), None)


def test_load_chat_template_from_file(tok, tmp_path):
    (tmp_path / "t.jinja").write_text(ZEPHYR)
    assert load_chat_template(tok, str(tmp_path / "t.jinja")) == ZEPHYR
    with pytest.raises(ChatTemplateError, match="not found"):
        load_chat_template(tok, str(tmp_path / "missing.jinja"))


def test_tokenize_command_writes_a_distilled_format_dataset(llama_dir, tmp_path):
    src = tmp_path / "chats.jsonl"
    rows = [{"messages": MESSAGES}, {"prompt": "Hi", "completion": "Hello"}, {"prompt": "no answer"},
            {"messages": MESSAGES + [{"role": "user", "content": "x " * 400}]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "t.jinja").write_text(ZEPHYR)
    cfg = TokenizeConfig(source=str(src), output=str(tmp_path / "out"), target=str(llama_dir),
                         chat_template=str(tmp_path / "t.jinja"), skip_bad_rows=True, max_length=200)
    ds = load_distilled(tokenize_dataset(cfg))
    assert len(ds) == 2 and ds["id"] == ["0", "1"]  # the answerless row skipped, the long one dropped
    manifest = json.loads((tmp_path / "out" / "headway_tokenize.json").read_text())
    assert manifest["bad_rows_skipped"] == 1 and manifest["dropped"] == 1
    t = copy.deepcopy(tiny_tokenizer())
    assert masked_spans(t, ds[0]["input_ids"], ds[0]["loss_mask"]) == ["Hello there!<|eos|>", "See you.<|eos|>"]
    assert (tmp_path / "out" / "token_counts.safetensors").is_file()
