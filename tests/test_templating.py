import numpy as np

from eagleflow.data.templating import (
    has_generation_markers,
    tokenize_conversation,
    tokenizer_digest,
)

MESSAGES = [
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "2 plus 3 is 5."},
    {"role": "user", "content": "Now multiply that by 2."},
    {"role": "assistant", "content": "5 times 2 is 10."},
]


def decoded_masked(tokenizer, t):
    return tokenizer.decode(t.input_ids[t.loss_mask.astype(bool)])


def test_mask_covers_exactly_the_assistant_text(tokenizer):
    assert has_generation_markers(tokenizer)
    t = tokenize_conversation(tokenizer, MESSAGES, 512)
    assert decoded_masked(tokenizer, t) == "2 plus 3 is 5.<|end|>5 times 2 is 10.<|end|>"
    assert tokenizer.decode(t.input_ids) == tokenizer.apply_chat_template(MESSAGES, tokenize=False)


def test_prefix_diff_path_agrees_with_generation_markers(tokenizer):
    """Templates without {% generation %} get masks from growing prefixes; both paths must mark
    exactly the same tokens."""
    plain = tokenizer.chat_template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""
    )
    tok2 = tokenizer.__class__(
        tokenizer_object=tokenizer.backend_tokenizer,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
    )
    tok2.chat_template = plain
    a = tokenize_conversation(tokenizer, MESSAGES, 512)
    b = tokenize_conversation(tok2, MESSAGES, 512)
    assert np.array_equal(a.input_ids, b.input_ids)
    assert not has_generation_markers(tok2)
    assert np.array_equal(b.loss_mask, a.loss_mask)


def test_truncation_and_digest(tokenizer):
    t = tokenize_conversation(tokenizer, MESSAGES, 7)
    assert len(t.input_ids) == len(t.loss_mask) == 7
    d1 = tokenizer_digest(tokenizer)
    tokenizer.chat_template, saved = tokenizer.chat_template + " ", tokenizer.chat_template
    try:
        assert tokenizer_digest(tokenizer) != d1
    finally:
        tokenizer.chat_template = saved
