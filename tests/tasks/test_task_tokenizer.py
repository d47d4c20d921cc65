from transformers import AutoTokenizer

from splitrl.tasks import TaskPrompt, build_char_tokenizer, encode_prompt, make_task, render_prompt
from splitrl.tasks.tokenizer import CHARACTERS


def test_one_id_per_character_and_round_trip():
    tokenizer = build_char_tokenizer()
    assert len(tokenizer) == 100
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id,
            tokenizer.unk_token_id) == (0, 1, 2, 3)
    ids = tokenizer(CHARACTERS)["input_ids"]
    assert ids == list(range(4, 100))
    assert tokenizer.decode(ids) == CHARACTERS
    text = "desc 5,2,7=7,5,2 604>406 4+1=5 a*b-c"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text


def test_unknown_characters_become_unk_without_crashing():
    tokenizer = build_char_tokenizer()
    ids = tokenizer("café\tx")["input_ids"]
    unk = tokenizer.unk_token_id
    assert ids == [tokenizer.convert_tokens_to_ids(c) for c in "caf"] + [unk, unk, ids[-1]]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "cafx"


def test_save_and_reload(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Sort: 9,1,4 -> 1,4,9!"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.get_vocab() == tokenizer.get_vocab()
    assert reloaded.eos_token_id == 2 and reloaded.pad_token_id == 0
    assert reloaded.decode(reloaded(text)["input_ids"]) == text


def test_render_prompt_plain_and_with_chat_template():
    tokenizer = build_char_tokenizer()
    prompt = make_task({"kind": "reverse_digits"}).get_prompt(0)
    assert tokenizer.chat_template is None
    assert render_prompt(prompt, tokenizer) == prompt.text
    assert encode_prompt(prompt, tokenizer) == tokenizer(prompt.text)["input_ids"]

    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    hand = TaskPrompt(index=0, text="604>", answer="406")
    assert render_prompt(hand, tokenizer) == "<bos>[user]604>[assistant]"
    ids = encode_prompt(hand, tokenizer)
    assert ids.count(tokenizer.bos_token_id) == 1 and ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == "[user]604>[assistant]"
