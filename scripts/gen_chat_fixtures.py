#!/usr/bin/env python3
"""Renders real chat templates with jinja2 to get the expected prompts for d2o's ChatTemplate.

Writes tests/data/chat/expected.json: for each template, conversation and add_generation_prompt
setting, the text the template renders. The templates are read from where they are published
at generation time and are not committed:
  - SmolLM2's, Qwen2's and Phi-3 mini's from their GGUF files ($D2O_MODEL, $D2O_VOCAB_DIR);
  - ChatML, Llama 3 and Mistral 7B Instruct (v0.2) from llama-cpp-python's llama_chat_format.py,
    Llama 3.1, Gemma 2 and Phi-3.5 from llama.cpp's models/templates, both in the
    llama-cpp-python source archive ($LLAMA_CPP_PYTHON_DIR, the unpacked sdist);
  - Llama 2 chat from transformers 4.36's LlamaTokenizer.default_chat_template (the wheel is
    fetched from PyPI with pip into a temporary folder).
Rendering follows transformers (jinja2 sandbox, trim_blocks, lstrip_blocks, loopcontrols,
raise_exception); a template that raises (e.g. Gemma 2 on a system message) gives no entry.

    pip install jinja2 gguf
    LLAMA_CPP_PYTHON_DIR=.../llama_cpp_python-0.3.36 D2O_MODEL=.../SmolLM2-135M-Instruct.Q4_1.gguf \
    D2O_VOCAB_DIR=.../shared/data/vocab python3 scripts/gen_chat_fixtures.py
"""
import ast
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile

import gguf
import jinja2
import jinja2.ext
import jinja2.sandbox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "chat", "expected.json")

CONVERSATIONS = {
    "system": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Hello! Who are you?"},
        {"role": "assistant", "content": " I am d2o's test model. "},
        {"role": "user", "content": "Tell me a joke\nabout tokens.  "},
    ],
    "plain": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "whitespace": [
        {"role": "user", "content": "\u3000 naïve 日本語 😀\t"},
        {"role": "assistant", "content": "\x1c ok \u00a0"},
        {"role": "user", "content": "bye\u2028"},
    ],
}


def gguf_template(path):
    r = gguf.GGUFReader(path)
    f = r.fields["tokenizer.chat_template"]
    return bytes(f.parts[-1]).decode("utf-8")


def py_constants(path, names):
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            t = node.targets[0]
            if isinstance(t, ast.Name) and t.id in names:
                out[t.id] = ast.literal_eval(node.value)
    return out


def llama2_template():
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "transformers==4.36.2", "-d", d], check=True)
        whl = glob.glob(os.path.join(d, "*.whl"))[0]
        src = zipfile.ZipFile(whl).read("transformers/models/llama/tokenization_llama.py").decode()
    body = re.search(r"template = \((.*?)\n\s*\)\n", src, re.S).group(1)
    body = re.sub(r"#[^\n]*", "", body)  # comments between the string pieces
    tmpl = ast.literal_eval("(" + body + ")")
    return tmpl.replace("USE_DEFAULT_PROMPT", "false").replace("DEFAULT_SYSTEM_MESSAGE", "")


def render(template, messages, add_generation_prompt, bos, eos):
    def raise_exception(msg):
        raise jinja2.exceptions.TemplateError(msg)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, bos_token=bos, eos_token=eos,
                                            add_generation_prompt=add_generation_prompt)


def main():
    sdist = os.environ["LLAMA_CPP_PYTHON_DIR"]
    vocab_dir = os.environ["D2O_VOCAB_DIR"]
    tdir = os.path.join(sdist, "vendor", "llama.cpp", "models", "templates")
    consts = py_constants(os.path.join(sdist, "llama_cpp", "llama_chat_format.py"),
                          {"CHATML_CHAT_TEMPLATE", "LLAMA3_INSTRUCT_CHAT_TEMPLATE",
                           "MIXTRAL_INSTRUCT_CHAT_TEMPLATE"})
    read = lambda name: open(os.path.join(tdir, name), encoding="utf-8").read()
    # (id, how the test builds the ChatTemplate, expected format, template, bos, eos)
    templates = [
        ("smollm2", "gguf:smollm2", "chatml", gguf_template(os.environ["D2O_MODEL"]),
         "<|im_start|>", "<|im_end|>"),
        ("qwen2", "gguf:qwen2", "chatml",
         gguf_template(os.path.join(vocab_dir, "ggml-vocab-qwen2.gguf")),
         "<|endoftext|>", "<|endoftext|>"),
        ("phi3-mini", "gguf:phi-3", "phi3",
         gguf_template(os.path.join(vocab_dir, "ggml-vocab-phi-3.gguf")), "<s>", "<|endoftext|>"),
        ("chatml", "name:chatml", "chatml", consts["CHATML_CHAT_TEMPLATE"], "", "<|im_end|>"),
        ("llama3", "name:llama3", "llama3", consts["LLAMA3_INSTRUCT_CHAT_TEMPLATE"],
         "<|begin_of_text|>", "<|eot_id|>"),
        ("llama3.1", "name:llama3.1", "llama3.1", read("meta-llama-Llama-3.1-8B-Instruct.jinja"),
         "<|begin_of_text|>", "<|eot_id|>"),
        ("mistral", "name:mistral", "mistral", consts["MIXTRAL_INSTRUCT_CHAT_TEMPLATE"], "<s>",
         "</s>"),
        ("llama2", "name:llama2", "llama2", llama2_template(), "<s>", "</s>"),
        ("gemma", "name:gemma", "gemma", read("google-gemma-2-2b-it.jinja"), "<bos>", "<eos>"),
        ("phi3.5", "name:phi3", "phi3", read("microsoft-Phi-3.5-mini-instruct.jinja"), "<s>",
         "<|endoftext|>"),
    ]
    cases = []
    for tid, build, fmt, tmpl, bos, eos in templates:
        for conv_name, messages in CONVERSATIONS.items():
            for agp in (True, False):
                try:
                    text = render(tmpl, messages, agp, bos, eos)
                except jinja2.exceptions.TemplateError as e:
                    print(f"{tid}/{conv_name}: template raises ({e}); skipped")
                    continue
                cases.append({"template": tid, "build": build, "format": fmt,
                              "conversation": conv_name, "add_generation_prompt": agp,
                              "expected": text})
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump({"conversations": CONVERSATIONS, "cases": cases}, f, ensure_ascii=False,
                  indent=1)
        f.write("\n")
    print(f"{OUT}: {len(cases)} cases")


if __name__ == "__main__":
    main()
