"""`--chat-template`: a Jinja chat template for the chat lines, read and checked before any work."""

from __future__ import annotations

import os

JINJA_CHARACTERS = "{}\n"  # vLLM's rule: a value with one of these that is no file is the template itself


def load_chat_template(value: str | None) -> str | None:
    """The template text of --chat-template VALUE: the file VALUE, or VALUE itself when it is no
    file and holds Jinja syntax (as vLLM reads the option). ValueError naming the fix when the
    file cannot be read or the template does not compile."""
    if value is None:
        return None
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError) as error:
            raise ValueError(f"cannot read the chat template {value!r}: {error} (fix: a readable UTF-8 Jinja "
                             "file)") from None
        where = value
    elif any(character in value for character in JINJA_CHARACTERS):
        text, where = value, "--chat-template"
    else:
        raise ValueError(f"chat template file {value!r} not found (fix: check the path of the Jinja file)")
    _check_syntax(text, where)
    return text


def _check_syntax(text: str, where: str) -> None:
    """Compile the template as transformers does when it renders a chat (its own Jinja
    environment and extensions)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"chat template {where}, line {error.lineno}: {error.message} (fix: correct the Jinja "
                         "syntax)") from None
