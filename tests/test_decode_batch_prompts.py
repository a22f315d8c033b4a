"""Issue #63.9: ``generate_batch`` names the row of a bad prompt. ``None`` in the list was a raw
TypeError; an empty prompt, one past the target's context or a bad per-row setting did not say
which row it was."""

import pytest
import torch

from headway.decode import Speculator
from headway.decode.args import DecodeError, check_prompt_list, row_named
from headway.heads import MedusaHeads
from headway.testing import tiny_target
from headway.tokenizer import encode_prompt


@pytest.mark.parametrize("prompts, words", [
    ("one prompt", "non-empty list of prompts"),
    ([], "non-empty list of prompts"),
    (torch.ones(2, 3, dtype=torch.long), "non-empty list of prompts"),
    (["a", None], "prompts[1] is NoneType, not a prompt"),
    ([[1, 2], "b", 7], "prompts[2] is int, not a prompt"),
    ([{"role": "user", "content": "hi"}], "prompts[0] is dict, not a prompt"),  # a message, not a list of them
])
def test_the_prompt_list_names_its_first_bad_row(prompts, words):
    with pytest.raises(DecodeError) as e:
        check_prompt_list(prompts)
    assert words in str(e.value)


def test_good_prompt_lists_pass():
    check_prompt_list(["a", [1, 2], (3,), torch.tensor([4, 5]), [{"role": "user", "content": "hi"}]])


def test_row_named_prefixes_decode_errors_only():
    with pytest.raises(DecodeError, match=r"^prompts\[3\]: the prompt is empty$"):
        with row_named(3):
            raise DecodeError("the prompt is empty")
    with pytest.raises(KeyError):  # not a decoding argument: passed on as it is
        with row_named(3):
            raise KeyError("x")


@pytest.mark.parametrize("prompt, words", [(None, "not NoneType"), (5, "not int"), ([], "the prompt is empty"),
                                           ([1, None], "token ids must be whole numbers, got None"),
                                           (["x", 1], "token ids must be whole numbers, got 'x'")])
def test_encode_prompt_refuses_what_is_no_prompt(prompt, words):
    with pytest.raises(ValueError, match=words):
        encode_prompt(None, prompt)


@pytest.fixture(scope="module")
def spec():
    model, tok = tiny_target("llama", num_hidden_layers=2)
    return Speculator(model, tok, MedusaHeads.for_target(model, num_heads=2), tree="chain-2")


@pytest.mark.parametrize("prompts, kw, message", [
    (["def f():", None], {}, "prompts[1] is NoneType, not a prompt"),
    (["def f():", "x", ""], {}, "prompts[2]: the prompt is empty"),
    ([[5, 6], [5, None]], {}, "prompts[1]: token ids must be whole numbers, got None"),
    ([[5, 6], [7] * 600], {}, "prompts[1]: the prompt has 600 tokens and max_new_tokens is 4"),
    ([[5, 6], [7, 8]], {"temperature": [0.5, -1.0]}, "prompts[1]: temperature must be a finite number >= 0"),
])
def test_generate_batch_names_the_bad_row(spec, prompts, kw, message):
    with pytest.raises(DecodeError) as e:
        spec.generate_batch(prompts, max_new_tokens=4, **kw)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_generate_refuses_none_in_one_line(spec):
    with pytest.raises(DecodeError, match="^a prompt is a string, token ids or a list of messages, not NoneType$"):
        spec.generate(None, max_new_tokens=4)
