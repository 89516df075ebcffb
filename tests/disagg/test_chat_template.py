"""A checkpoint's chat template: where it is read from, and rendered as HF transformers
renders it (jinja2, sandboxed, trim_blocks / lstrip_blocks, HF's globals and filters)."""

import json

import pytest

pytest.importorskip("jinja2")
tokenizers = pytest.importorskip("tokenizers")

from drafter.tokenizer import (ChatTemplate, ChatTemplateError, TokenizerError,  # noqa: E402
                               load_tokenizer)


def checkpoint(root, config=None, files=None):
    """A word-level tokenizer.json, a tokenizer_config.json and other template files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    root.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", "[user]", "hi", "[A]", "ok"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(config or {}))
    for name, text in (files or {}).items():
        (root / name).write_text(text)
    return root


def test_template_files_in_order_and_none_without_one(tmp_path):
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": None,
              "chat_template": "{{ bos_token }} config"}
    assert load_tokenizer(checkpoint(tmp_path / "none")).chat_template is None
    tok = load_tokenizer(checkpoint(tmp_path / "config", config))
    assert tok.chat_template.render([]) == "<s> config"
    assert tok.chat_template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    tok = load_tokenizer(checkpoint(tmp_path / "json", config, {
        "chat_template.json": json.dumps({"chat_template": "json {{ eos_token }}"})}))
    assert tok.chat_template.render([]) == "json </s>"
    tok = load_tokenizer(checkpoint(tmp_path / "jinja", config, {
        "chat_template.json": json.dumps({"chat_template": "json"}),
        "chat_template.jinja": "jinja"}))
    assert tok.chat_template.render([]) == "jinja"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "d"}]
    tok = load_tokenizer(checkpoint(tmp_path / "named", {"chat_template": named}))
    assert tok.chat_template.render([]) == "d"


def test_a_template_that_cannot_be_used_is_refused_at_load_naming_the_file(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json.*does not compile"):
        load_tokenizer(checkpoint(tmp_path / "a", {"chat_template": "{% for %}"}))
    with pytest.raises(TokenizerError, match="none named \"default\""):
        load_tokenizer(checkpoint(tmp_path / "b", {"chat_template": [
            {"name": "tool_use", "template": "t"}]}))
    with pytest.raises(TokenizerError, match="must be a string"):
        load_tokenizer(checkpoint(tmp_path / "c", {"chat_template": 7}))


def test_encode_chat_renders_with_the_generation_prompt_and_no_added_specials(tmp_path):
    template = "<s> " + "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}" \
        "{% if add_generation_prompt %}[A]{% endif %}"
    tok = load_tokenizer(checkpoint(tmp_path, {"chat_template": template}))
    assert tok.encode_chat([{"role": "user", "content": "hi"}]) == [1, 3, 4, 5]


def test_rendering_follows_hf_transformers():
    source = ("{% for m in messages %}\n  {{ m.content | tojson }}\n{% endfor %}"
              "{% generation %}{{ loop_ok }}{% endgeneration %}"
              "{% for x in [1, 2, 3] %}{% if x == 2 %}{% break %}{% endif %}{{ x }}{% endfor %}")
    t = ChatTemplate(source, {}, "t")
    # trim_blocks + lstrip_blocks; tojson keeps <, > and non-ASCII as they are
    assert t.render([{"role": "user", "content": "<é>"}]) == '  "<é>"\n1'
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}", {}, "t")
    with pytest.raises(ChatTemplateError, match="refused these messages: roles must alternate"):
        refusing.render([])
    failing = ChatTemplate("{{ messages[3].content }}", {}, "t")
    with pytest.raises(ChatTemplateError, match="UndefinedError"):
        failing.render([])
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", {}, "t")
    with pytest.raises(ChatTemplateError, match="SecurityError|UndefinedError"):
        sandboxed.render([])


def test_template_variables_and_continuing_the_final_message():
    """chat_template_kwargs reach the template as variables (Qwen3's enable_thinking);
    continue_final_message cuts the text just after the final message's content, as HF
    does (the content stripped), and is refused where the template does not render it."""
    t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>"
                     "{% endfor %}{% if add_generation_prompt %}<assistant>"
                     "{% if not enable_thinking | default(true) %}<no-think>{% endif %}"
                     "{% endif %}", {"eos_token": "</s>"}, "t")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    assert t.render(chat[:1]) == "<user>hi</user><assistant>"
    assert t.render(chat[:1], variables={"enable_thinking": False}) == \
        "<user>hi</user><assistant><no-think>"
    assert t.render(chat, add_generation_prompt=False, continue_final_message=True) == \
        "<user>hi</user><assistant>Sure,"
    with pytest.raises(ChatTemplateError, match="cannot be continued"):
        ChatTemplate("{{ messages | length }}", {}, "t").render(
            chat, add_generation_prompt=False, continue_final_message=True)
