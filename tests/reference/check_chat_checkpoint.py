#!/usr/bin/env python3
"""A checkpoint dstrain wrote after fine-tuning on conversations, used as a chat model in Hugging
Face transformers: its tokenizer (the chat template in tokenizer_config.json) renders a
conversation with the generation prompt, and the model generates a reply to it.

    /usr/bin/python3 tests/reference/check_chat_checkpoint.py CHECKPOINT_DIR

Exit 0 when the template renders, its ids are the tokenizer's ids of the rendered text, and
generate() returns new tokens; 1 otherwise; 77 when torch, transformers or jinja2 (which
apply_chat_template needs) is not installed."""
import sys

try:
    import jinja2  # noqa: F401 (transformers renders chat templates with it)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
except ImportError:
    print("torch, transformers or jinja2 is not installed: skipped")
    sys.exit(77)


def main():
    directory = sys.argv[1]
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    messages = [{"role": "user", "content": "what is 3 plus 1?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    if ids[0].tolist() != tokenizer.encode(text, add_special_tokens=False):
        print("apply_chat_template's ids are not the rendered text's")
        return 1
    torch.manual_seed(0)
    out = model.generate(ids, max_new_tokens=8, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    reply = tokenizer.decode(out[0, ids.shape[1]:])
    print("prompt:", repr(text))
    print("reply: ", repr(reply))
    return 0 if out.shape[1] > ids.shape[1] else 1


if __name__ == "__main__":
    sys.exit(main())
