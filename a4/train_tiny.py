"""Train the tiny Qwen3.5 that ships in a4/trained/qwen3_5-tiny/: a model of a few MB that writes text.

    python -m a4.train_tiny [--out DIR] [--steps N] [--device cuda|cpu]

What it does, deterministic (seed 0), on the GPU where there is one and on the CPU otherwise:
1. draws the corpus (a4/tiny_corpus.py: templated stories, facts, sums, chats and quizzes in Qwen's template; text this
   project writes, under the project's licence) and trains a byte-level BPE tokenizer on it with `tokenizers`
   (Qwen3.5's pre-tokenizer regex and byte-level alphabet; the special tokens of Qwen's template after the merges,
   where Qwen's own tokenizer keeps them);
2. builds Qwen3.5's language model with transformers' own classes (Gated DeltaNet and gated full-attention layers in
   the real 3:1 pattern, partial RoPE, zero-centred norms, tied embeddings), beside an MTP module laid out as the real
   checkpoint's `mtp.*` (a4/models/qwen3_5_mtp.py reads it);
3. trains both together with AdamW: the model on the next token, the MTP module on the token after it (from the
   model's final hidden state at t and the embedding of token t + 1, as Qwen3-Next and DeepSeek-V3 train theirs),
   the sum of the two cross-entropies as the loss;
4. writes the checkpoint in the files and format of a real one: config.json (with text_config and a vision_config;
   the vision tower's weights are random, unused by a4, present because real checkpoints carry it),
   generation_config.json, model.safetensors (float32), tokenizer.json, tokenizer_config.json (with Qwen's chat
   template), and training_log.json: the loss of every step and the held-out losses, which tests/test_trained_checkpoint
   reproduces the start of.

2,000 steps of 64 x 256 tokens (33M tokens). The shipped run took 3.2 minutes on one H100 (`training_log.json`
records its device, wall time and recipe). The GPU runs the same float32 arithmetic as the CPU (transformers' PyTorch
Gated DeltaNet, TF32 off): its first steps' losses are the CPU's to ~1e-7, and tests/test_trained_checkpoint.py
reruns them on the CPU. On the CPU alone the whole run is about 9 s a step on one core of this project's 2-core
machine, some 5 hours: it runs, but a GPU is what makes it minutes. `python -m a4.tiny_eval` asks the result every
question of its world. The shipped checkpoint is this script's output:
`a4.checkpoints.tiny_checkpoint("qwen3_5", trained=True)` returns it.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from a4 import tiny_corpus
from a4.checkpoints import TRAINED_DIR, random_tensors, resolved_configs

SEED = 0
HELD_OUT_SEED = 1  # the corpus seed of the held-out documents
# More than STEPS batches need. The corpus is drawn in order: a shorter run reads the same first documents.
TRAIN_DOCUMENTS = 600_000
TOKENIZER_DOCUMENTS = 10_000  # the first documents, which already hold every word of the corpus's lists
HELD_OUT_DOCUMENTS = 500
ENCODE_BLOCK = 1000  # documents tokenized at once (`encode_batch` runs them on every core)
BPE_VOCAB = 4096  # an upper bound: the corpus's words are few, and BPE stops when no pair is left to merge
VOCAB_MULTIPLE = 64  # config.json's vocab_size is the tokenizer's rounded up, as Qwen pads its own
SEQUENCE_LENGTH = 256
BATCH_SIZE = 64
STEPS = 2000
PEAK_LR = 4e-3
WARMUP_STEPS = 50
FINAL_LR_FRACTION = 0.1
WEIGHT_DECAY = 0.01
MAX_GRAD_NORM = 1.0
MTP_LOSS_WEIGHT = 0.5  # below the main loss, as DeepSeek-V3 weighs its MTP loss
# Qwen3.5's shapes scaled down: the real 3:1 pattern of Gated DeltaNet and full-attention layers, partial RoPE
# (a quarter of head_dim), grouped key/value heads on both kinds of layer.
TEXT_CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "max_position_embeddings": 2048,
    "dtype": "float32",
}
# The special tokens of Qwen's vocabulary that this model's config names: the chat template's, then the vision
# tower's (config.json points at them; text never contains them).
VISION_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}
SPECIAL_TOKENS = (*tiny_corpus.SPECIAL_TOKENS, *VISION_TOKENS.values())
# Qwen's chat template, without tools and reasoning: each message between <|im_start|>role and <|im_end|>.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# --------------------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(documents: list[str]):
    """Byte-level BPE with Qwen3.5's pre-tokenizer, trained on the documents; special tokens after the merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    # The merges are learnt from the text between special tokens: a special token is one id, never bytes.
    tokenizer.train_from_iterator((plain_text(document) for document in documents), trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def plain_text(document: str) -> str:
    for token in tiny_corpus.SPECIAL_TOKENS:
        document = document.replace(token, "\n")
    return document


def tokenizer_config(tokenizer) -> dict:
    """tokenizer_config.json as Qwen's: its tokenizer class, special tokens and chat template."""
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }  # fmt: skip
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [tiny_corpus.IM_START, tiny_corpus.IM_END],
        "bos_token": None,
        "eos_token": tiny_corpus.IM_END,
        "pad_token": tiny_corpus.END_OF_TEXT,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": TEXT_CONFIG["max_position_embeddings"],
        "split_special_tokens": False,
    }


# ------------------------------------------------------------------------------------------------------------ config


def checkpoint_configs(tokenizer) -> tuple[dict, dict]:
    """config.json and generation_config.json: the tiny preset with TEXT_CONFIG, this tokenizer's vocabulary and
    special token ids (generation stops at <|im_end|> or <|endoftext|>, as Qwen's does)."""

    vocab_size = math.ceil(tokenizer.get_vocab_size() / VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    config, generation = resolved_configs("qwen3_5", "tiny", vocab_size=vocab_size, **TEXT_CONFIG)
    end_of_text, im_end = (tokenizer.token_to_id(t) for t in (tiny_corpus.END_OF_TEXT, tiny_corpus.IM_END))
    config["text_config"]["eos_token_id"] = end_of_text
    config.update({key: tokenizer.token_to_id(token) for key, token in VISION_TOKENS.items()})
    generation.update(bos_token_id=end_of_text, pad_token_id=end_of_text, eos_token_id=[im_end, end_of_text])
    return config, generation


# ------------------------------------------------------------------------------------------------------------- model


class MTPModule(nn.Module):
    """The multi-token-prediction module for training, in transformers' layers, its parameter names those of the
    checkpoint's `mtp.*` (a4/models/qwen3_5_mtp.py is the same computation over the engine's KV pool):

        x = fc(cat(pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)))  at position i
        logits of t_{i+2} = lm_head(norm(full-attention decoder layer(x)))
    """

    def __init__(self, text_config):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

        super().__init__()
        hidden, eps = text_config.hidden_size, text_config.rms_norm_eps
        full_attention = text_config.layer_types.index("full_attention")  # a layer index of that kind, for its type
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(text_config, full_attention)])
        self.norm = Qwen3_5RMSNorm(hidden, eps)

    def forward(self, model, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of the token after next_ids, from hidden [B, T, H] (the model's final, normed hidden
        states at positions 0..T-1) and next_ids [B, T] (the tokens at positions 1..T)."""
        embedded = self.pre_fc_norm_embedding(model.model.embed_tokens(next_ids))
        x = self.fc(torch.cat((embedded, self.pre_fc_norm_hidden(hidden)), dim=-1))
        # Text positions on all three of the rotary embedding's (t, h, w) axes, as the model passes them.
        positions = torch.arange(x.shape[1], device=x.device).view(1, 1, -1).expand(3, x.shape[0], -1)
        position_embeddings = model.model.rotary_emb(x, positions)
        for layer in self.layers:
            x = layer(x, position_embeddings=position_embeddings, attention_mask=None)  # sdpa: causal
        return model.lm_head(self.norm(x))


def build_models(config: dict):
    """transformers' Qwen3.5 language model and the MTP module, initialised as transformers initialises Qwen3.5."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    text_config = Qwen3_5TextConfig(**config["text_config"])
    text_config._attn_implementation = "sdpa"  # causal without a mask tensor, for the MTP layer too
    torch.manual_seed(SEED)
    model = Qwen3_5ForCausalLM(text_config)
    mtp = MTPModule(text_config)
    mtp.apply(model._init_weights)
    return model, mtp


def logits(model, mtp: MTPModule, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For the batch ids [B, T]: the model's logits of tokens 1..T-1 and the MTP module's of tokens 2..T-1."""
    hidden = model.model(input_ids=ids).last_hidden_state
    # Position i reads h_i and token i + 1 and predicts token i + 2.
    return model.lm_head(hidden[:, :-1]), mtp(model, hidden[:, :-2], ids[:, 1:-1])


def losses(model, mtp: MTPModule, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of the next token (model) and of the token after it (MTP) over the batch ids [B, T]."""
    main_logits, mtp_logits = logits(model, mtp, ids)
    return (
        F.cross_entropy(main_logits.flatten(0, 1), ids[:, 1:].flatten()),
        F.cross_entropy(mtp_logits.flatten(0, 1), ids[:, 2:].flatten()),
    )


# -------------------------------------------------------------------------------------------------------------- data


def pack(tokenizer, documents: list[str], max_rows: int | None = None) -> torch.Tensor:
    """Rows of SEQUENCE_LENGTH tokens, each starting with a document (as a prompt starts at position 0): documents
    follow one another after <|endoftext|>; the one that overflows a row is cut there, and the next row starts anew.
    Stops after max_rows rows (a short run tokenizes only what it trains on)."""
    end_of_text = tokenizer.token_to_id(tiny_corpus.END_OF_TEXT)
    rows, row = [], []
    for start in range(0, len(documents), ENCODE_BLOCK):
        for encoding in tokenizer.encode_batch(documents[start : start + ENCODE_BLOCK]):
            row += [*encoding.ids, end_of_text]
            if len(row) >= SEQUENCE_LENGTH:
                rows.append(row[:SEQUENCE_LENGTH])
                row = []
                if len(rows) == max_rows:
                    return torch.tensor(rows)
    return torch.tensor(rows)


def learning_rate(step: int, total_steps: int) -> float:
    """Linear warm-up, then cosine decay to FINAL_LR_FRACTION of the peak at total_steps."""
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
    return PEAK_LR * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def held_out_losses(model, mtp: MTPModule, rows: torch.Tensor) -> dict:
    """Mean losses and the MTP module's top-1 accuracy (teacher-forced: its draft at k = 1) over held-out rows."""
    model.eval(), mtp.eval()
    device = model.lm_head.weight.device
    totals = torch.zeros(3, device=device)
    for batch in rows.to(device).split(BATCH_SIZE):
        main_logits, mtp_logits = logits(model, mtp, batch)
        totals += len(batch) * torch.stack([
            F.cross_entropy(main_logits.flatten(0, 1), batch[:, 1:].flatten()),
            F.cross_entropy(mtp_logits.flatten(0, 1), batch[:, 2:].flatten()),
            (mtp_logits.argmax(-1) == batch[:, 2:]).float().mean(),
        ])  # fmt: skip
    model.train(), mtp.train()
    loss, mtp_loss, mtp_top1 = (totals / len(rows)).tolist()
    return {"loss": loss, "mtp_loss": mtp_loss, "mtp_top1": mtp_top1}


# ---------------------------------------------------------------------------------------------------------- training


def train(out_dir: Path | None, steps: int = STEPS, log_every: int = 25, device: str = "cpu") -> dict:
    """Train from scratch for `steps` steps of the full run's schedule (so that a short run's steps are the full
    run's first ones), measure the held-out losses and write the checkpoint into out_dir; out_dir=None: neither
    measure nor write, only the log of the steps (what the reproduction test compares). Returns the training log.

    On a GPU the model is built on the CPU, as there (the same initial weights), then moved; float32 throughout,
    TF32 off, and transformers' own PyTorch Gated DeltaNet (flash-linear-attention must not be installed), so that
    the steps are the CPU's up to the order of summation."""
    start = time.perf_counter()
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    train_documents = tiny_corpus.documents(SEED, TRAIN_DOCUMENTS)
    tokenizer = train_tokenizer(train_documents[:TOKENIZER_DOCUMENTS])
    config, generation = checkpoint_configs(tokenizer)
    rows = pack(tokenizer, train_documents, max_rows=steps * BATCH_SIZE)
    if len(rows) < steps * BATCH_SIZE:
        raise ValueError(f"{TRAIN_DOCUMENTS} documents give {len(rows)} rows, fewer than {steps} steps need")
    model, mtp = (module.to(device) for module in build_models(config))
    parameters = [*model.parameters(), *mtp.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY)
    log = {"steps": []}
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, STEPS)
        main, mtp_loss = losses(model, mtp, rows[step * BATCH_SIZE : (step + 1) * BATCH_SIZE].to(device))
        optimizer.zero_grad()
        (main + MTP_LOSS_WEIGHT * mtp_loss).backward()
        torch.nn.utils.clip_grad_norm_(parameters, MAX_GRAD_NORM)
        optimizer.step()
        log["steps"].append({"step": step, "loss": main.item(), "mtp_loss": mtp_loss.item()})
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:>4}  loss {main.item():.4f}  mtp loss {mtp_loss.item():.4f}  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    if out_dir is None:
        return log
    held_out = pack(tokenizer, tiny_corpus.documents(HELD_OUT_SEED, HELD_OUT_DOCUMENTS))
    log["held_out"] = held_out_losses(model, mtp, held_out)
    log |= {
        "seed": SEED, "total_steps": steps, "peak_lr": PEAK_LR, "warmup_steps": WARMUP_STEPS,
        "train_documents": TRAIN_DOCUMENTS, "held_out_documents": HELD_OUT_DOCUMENTS,
        "held_out_rows": len(held_out), "sequence_length": SEQUENCE_LENGTH, "batch_size": BATCH_SIZE,
        "tokens_trained": steps * BATCH_SIZE * SEQUENCE_LENGTH, "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu",
        "wall_seconds": time.perf_counter() - start,
    }  # fmt: skip
    write_checkpoint(Path(out_dir), config, generation, tokenizer, model, mtp, log)
    return log


def write_checkpoint(out_dir: Path, config: dict, generation: dict, tokenizer, model, mtp, log: dict) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    # transformers' language model keys are model.*, a Qwen3_5ForConditionalGeneration checkpoint's
    # model.language_model.*; lm_head is tied to the embedding and not stored.
    tensors = {
        name.replace("model.", "model.language_model.", 1): tensor.cpu()
        for name, tensor in model.state_dict().items()
        if not name.startswith("lm_head.")
    }
    tensors |= {f"mtp.{name}": tensor.cpu() for name, tensor in mtp.state_dict().items()}
    tensors |= {name: t.float() for name, t in random_tensors("qwen3_5", config, SEED, "model.visual.").items()}
    save_file({name: t.contiguous() for name, t in sorted(tensors.items())}, out_dir / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer), indent=2) + "\n")
    (out_dir / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors writes it private; it ships in the package


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m a4.train_tiny", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=TRAINED_DIR, help=f"checkpoint directory (default: {TRAINED_DIR})")
    parser.add_argument("--steps", type=int, default=STEPS, help="a shorter run (its schedule is still the full one's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where to train (default: the GPU where there is one)")  # fmt: skip
    args = parser.parse_args(argv)
    log = train(args.out, steps=args.steps, device=args.device)
    held_out = log["held_out"]
    print(
        f"held-out loss {held_out['loss']:.4f}, MTP loss {held_out['mtp_loss']:.4f}, MTP top-1 "
        f"{held_out['mtp_top1']:.1%}; {log['wall_seconds']:.0f} s on {log['device']} ({log['threads']} threads); "
        f"wrote {args.out}"
    )


if __name__ == "__main__":
    main()
