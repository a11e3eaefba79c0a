"""Train pagegate's embedded default model: a tiny Llama trained on the King James Bible.

The result is a Hugging Face checkpoint folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json, README.md) written to
pagegate/engine/default_model/, small enough (about 14 MB) to ship inside the package so that
`LLM()` and `pagegate serve` work on a fresh machine with no download.

Text source and licence
    The King James Version of the Bible (1611), as packaged by Debian in `bible-kjv-text`
    (the text) and `bible-kjv` (the `bible` retrieval program, GPL-2+, used only to print the
    text). The KJV text is in the public domain (Debian's copyright file: "The copyright for the
    King James Version text of the Bible is expired"). The model and tokenizer are derived from
    that text only. When data/kjv.txt is missing, this script fetches the two .deb files with
    `apt-get download` (no install), unpacks them with `dpkg-deb -x` and runs
    `bible -p <lib> Gen1:1-Rev22:21`.

What it trains
    * A byte-level BPE tokenizer (`tokenizers`, vocabulary 2,048) with the special tokens
      <|begin_of_text|> (bos), <|end_of_text|> (eos) and the chat markers <|system|>, <|user|>,
      <|assistant|>, <|end|>. Encoding with special tokens prepends bos.
    * A LlamaForCausalLM: hidden 256, 4 layers, 4 query heads sharing 2 KV heads (GQA),
      MLP 688, tied embeddings, RoPE theta 10,000, 2,048 positions (trained at 256): 3.4M
      parameters.
    * Training documents are the Bible's chapters (one verse a line, verse numbers dropped) plus
      synthetic chat exchanges built from the same verses (continue a verse, recite a reference,
      "what does the Bible say about <word>"), rendered with the shipped chat template so the
      model learns the chat markers and to end its turn with <|end|><|end_of_text|>. Every
      document is <|begin_of_text|> ... <|end_of_text|>; documents are concatenated and random
      256-token windows are sampled. Twelve chapters are held out for a validation loss.
    * AdamW (betas 0.9/0.95, weight decay 0.1), linear warmup then cosine decay, gradient
      clipping 1.0, bf16 autocast on CPU with float32 master weights, torch.manual_seed and a
      seeded Python RNG: the same machine gives the same model.

Time: the default 2,000 steps of 16 x 256 tokens take about 18-20 minutes on 2 idle CPU cores
(measured 0.55 s a step with two threads). The machine is shared and its speed swings by 2x or
more, so training is also bounded by a time budget (--train-minutes, default 22): the cosine
schedule follows whichever of steps or elapsed time is further along, so a busy machine gets
fewer steps but a fully annealed model, and the whole script stays under 30 minutes. On an idle
machine the run is fixed by the step count; on a busy one the step count (recorded in the
folder's README) depends on the machine. A ThreadTuner drops to one thread while another
process holds a core (measured 2.4x faster than two threads then).

Reproduce (from the repository root):
    .venv/bin/python scripts/train_default_model.py
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import math
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "pagegate" / "engine" / "default_model"
DEFAULT_DATA = REPO_ROOT / "data"

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [BOS, EOS, SYSTEM, USER, ASSISTANT, END]  # ids 0..5 in this order
VOCAB_SIZE = 2048
MODEL_MAX_LENGTH = 2048

# Each message is its role's marker, a newline, the content and <|end|>; with
# add_generation_prompt the prompt ends with "<|assistant|>\n". Every newline is a string literal
# and every tag strips whitespace, so plain jinja2 and transformers (trim_blocks, lstrip_blocks)
# render the same text. No bos: encoding the rendered text with special tokens adds it.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ '<|system|>\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ '<|assistant|>\\n' }}"
    "{%- else -%}{{ '<|user|>\\n' }}{%- endif -%}"
    "{{- message['content'] | trim -}}{{ '<|end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

KJV_PACKAGES = ("bible-kjv-text", "bible-kjv")
KJV_RANGE = "Gen1:1-Rev22:21"
HELD_OUT_EVERY = 100  # every 100th chapter (12 of 1,189) is validation only

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a helpful assistant.",
                  "Answer in the words of the King James Bible.", "You are a wise teacher."]
TOPIC_QUESTIONS = ["What does the Bible say about {w}?", "Tell me about {w}.",
                   "Give me a verse about {w}.", "What is {w}?", "Speak to me of {w}."]
CONTINUE_PROMPTS = ["{v}", "Continue: {v}", "What comes after this? {v}", "Go on. {v}"]
REFERENCE_PROMPTS = ["Recite {ref}.", "What does {ref} say?", "Quote {ref}.", "{ref}"]
CHAPTER_PROMPTS = ["Read me {book} {chapter}.", "How does {book} {chapter} begin?"]
STOPWORDS = set("""the and that with unto them they shall their thou thee thy thine have were which
from this there when upon also said into then will what your would should these those hath
before after about because every even shalt came come went made things thing""".split())


@dataclass
class Chapter:
    book: str
    number: int
    verses: list[str]

    @property
    def text(self) -> str:
        return "\n".join(self.verses)


# ----------------------------------------------------------------------------- the text


def fetch_kjv(data_dir: Path) -> Path:
    """Return data_dir/kjv.txt, extracting it from Debian's packages when missing."""
    target = data_dir / "kjv.txt"
    if target.exists():
        return target
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir) as tmp:
        work = Path(tmp)
        if subprocess.run(["apt-get", "download", *KJV_PACKAGES], cwd=work).returncode != 0:
            subprocess.run(["apt-get", "update"], check=True)  # package lists missing or stale
            subprocess.run(["apt-get", "download", *KJV_PACKAGES], cwd=work, check=True)
        root = work / "root"
        for deb in sorted(work.glob("*.deb")):
            print(f"unpacking {deb.name}", flush=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        text = subprocess.run([str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), KJV_RANGE],
                              check=True, capture_output=True, text=True).stdout
    target.write_text(text)
    return target


def parse_chapters(text: str) -> list[Chapter]:
    """Split the `bible` program's output into chapters of unwrapped verses.

    Layout: a blank line, a heading such as "1 Kings 3", a blank line, then verses that start
    with "  <n> " and wrap at 80 columns onto unindented continuation lines.
    """
    chapters: list[Chapter] = []
    previous_blank = True
    for line in text.splitlines():
        if not line.strip():
            previous_blank = True
            continue
        heading = re.fullmatch(r"(\S.*) (\d+)", line) if previous_blank else None
        verse = re.match(r"\s+\d+ (.*)", line)
        if heading:
            chapters.append(Chapter(heading.group(1), int(heading.group(2)), []))
        elif verse:
            chapters[-1].verses.append(verse.group(1).strip())
        else:
            chapters[-1].verses[-1] += " " + line.strip()
        previous_blank = False
    return chapters


# ----------------------------------------------------------------------------- documents


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render messages with CHAT_TEMPLATE (the same template the tokenizer ships)."""
    import jinja2

    template = jinja2.Environment().from_string(CHAT_TEMPLATE)
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def topic_word(verse: str, rng: random.Random) -> str | None:
    """A content word of the verse, for a "what does the Bible say about <word>" question."""
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", verse) if len(w) >= 4]
    words = [w for w in words if w not in STOPWORDS]
    return rng.choice(words) if words else None


def chat_exchange(chapter: Chapter, rng: random.Random) -> tuple[str, str]:
    """One synthetic (user, assistant) pair drawn from a chapter's verses."""
    verses, n = chapter.verses, len(chapter.verses)
    kind = rng.random()
    if kind < 0.35 and n >= 2:  # continue a verse
        i = rng.randrange(n - 1)
        k = rng.randint(1, 3)
        return rng.choice(CONTINUE_PROMPTS).format(v=verses[i]), " ".join(verses[i + 1:i + 1 + k])
    if kind < 0.70:  # a topic question answered by a verse that mentions it
        i = rng.randrange(n)
        word = topic_word(verses[i], rng)
        if word:
            answer = " ".join(verses[i:i + rng.randint(1, 2)])
            return rng.choice(TOPIC_QUESTIONS).format(w=word), answer
    if kind < 0.90:  # recite a reference
        i = rng.randrange(n)
        ref = f"{chapter.book} {chapter.number}:{i + 1}"
        return rng.choice(REFERENCE_PROMPTS).format(ref=ref), verses[i]
    prompt = rng.choice(CHAPTER_PROMPTS).format(book=chapter.book, chapter=chapter.number)
    return prompt, " ".join(verses[:3])


def chat_document(chapters: list[Chapter], rng: random.Random) -> str:
    """A rendered conversation: an optional system prompt and one or two exchanges."""
    messages: list[dict[str, str]] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(2 if rng.random() < 0.2 else 1):
        user, assistant = chat_exchange(rng.choice(chapters), rng)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return render_chat(messages)


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE; encoding with special tokens prepends <|begin_of_text|>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, bos_id)])
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json plus a tokenizer_config.json that transformers and pagegate both read."""
    tokenizer.save(str(out / "tokenizer.json"))
    added = {str(tokenizer.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False, "special": True}
             for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------- data stream


def encode_documents(tokenizer: Tokenizer, documents: list[str]) -> torch.Tensor:
    """Concatenate <bos> document <eos> for every document into one int64 stream."""
    eos_id = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents):
        ids += encoding.ids + [eos_id]
    return torch.tensor(ids, dtype=torch.long)


def sample_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of length+1 tokens (inputs plus next-token targets)."""
    starts = torch.randint(0, len(stream) - length - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + length + 1] for s in starts.tolist()])


# ----------------------------------------------------------------------------- model and training


def make_config(tokenizer: Tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
        max_position_embeddings=MODEL_MAX_LENGTH, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, initializer_range=0.02,
        bos_token_id=tokenizer.token_to_id(BOS), eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(EOS), architectures=["LlamaForCausalLM"],
    )


def progress(step: int, elapsed_s: float, args: argparse.Namespace) -> float:
    """How far through training we are: by step count, or by the time budget if that runs out first.

    On an idle machine the step count leads and the run is fixed at args.steps; on a busy one the
    clock leads, so the cosine schedule still anneals fully within args.train_minutes.
    """
    return max(step / args.steps, elapsed_s / (args.train_minutes * 60))


def lr_at(step: int, done: float, args: argparse.Namespace) -> float:
    """Linear warmup over args.warmup steps, then cosine decay to 10% of the peak at done == 1."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


class ThreadTuner:
    """Chooses 1 or `max_threads` intra-op threads by timing them.

    On an idle 2-core machine two threads are ~1.7x faster, but while another process holds a
    core, two threads wait on each other and one thread was measured 2.4x faster. So every
    `every_s` seconds the next `probe` steps run with the other count, and the faster median wins.
    """

    def __init__(self, max_threads: int, every_s: float = 60.0, probe: int = 4):
        self.choices = (max_threads, 1) if max_threads > 1 else (1,)
        self.current, self.every_s, self.probe = self.choices[0], every_s, probe
        self.times: dict[int, collections.deque] = {c: collections.deque(maxlen=probe) for c in self.choices}
        self.next_probe_at, self.probe_left = time.time() + every_s / 3, 0

    def threads_for(self) -> int:
        if len(self.choices) > 1 and not self.probe_left and time.time() >= self.next_probe_at:
            self.probe_left = self.probe
        threads = [c for c in self.choices if c != self.current][0] if self.probe_left else self.current
        torch.set_num_threads(threads)
        return threads

    def record(self, threads: int, seconds: float) -> None:
        self.times[threads].append(seconds)
        if self.probe_left:
            self.probe_left -= 1
            if not self.probe_left:
                self.current = min(self.choices, key=lambda c: statistics.median(self.times[c] or [math.inf]))
                self.next_probe_at = time.time() + self.every_s


def next_token_loss(model: LlamaForCausalLM, windows: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), windows[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, batches: list[torch.Tensor]) -> float:
    model.eval()
    loss = sum(next_token_loss(model, b).item() for b in batches) / len(batches)
    model.train()
    return loss


def train(model: LlamaForCausalLM, train_stream: torch.Tensor, val_batches: list[torch.Tensor],
          args: argparse.Namespace) -> dict:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(args.seed)
    tuner = ThreadTuner(args.threads)
    start, smooth, step = time.time(), None, 0
    model.train()
    while progress(step, time.time() - start, args) < 1.0:
        lr = lr_at(step, progress(step, time.time() - start, args), args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        threads, step_start = tuner.threads_for(), time.time()
        loss = next_token_loss(model, sample_windows(train_stream, args.batch_size, args.seq_len, gen))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        tuner.record(threads, time.time() - step_start)
        step += 1
        smooth = loss.item() if smooth is None else 0.95 * smooth + 0.05 * loss.item()
        if step % 25 == 0:
            elapsed = time.time() - start
            tok_s = step * args.batch_size * args.seq_len / elapsed
            print(f"step {step:5d}  loss {smooth:.3f}  lr {lr:.2e}  {tok_s:5.0f} tok/s  "
                  f"threads {threads}  {elapsed / 60:4.1f} min", flush=True)
        if step % args.eval_every == 0:
            print(f"step {step:5d}  val loss {evaluate(model, val_batches):.3f}", flush=True)
    if step < args.steps:
        print(f"NOTE: the {args.train_minutes}-minute budget ended training at step {step} "
              f"of {args.steps} (a busy machine); the schedule was compressed to fit", flush=True)
    return {"steps": step, "train_loss": smooth, "val_loss": evaluate(model, val_batches),
            "minutes": (time.time() - start) / 60}


# ----------------------------------------------------------------------------- output folder


def write_readme(out: Path, stats: dict, params: int, text_sha256: str, args: argparse.Namespace) -> None:
    (out / "README.md").write_text(f"""# pagegate default model: a tiny KJV Llama

A {params / 1e6:.1f}M-parameter Llama-architecture model (hidden 256, 4 layers, 4 query heads / 2 KV
heads, vocabulary {VOCAB_SIZE}, byte-level BPE) trained from scratch on the King James Bible. It
exists so that pagegate serves something with no download; it writes KJV-flavoured English and
knows nothing else.

- **Text:** the King James Version (1611) from Debian's `bible-kjv-text` package (printed with the
  `bible` program of `bible-kjv`, GPL-2+); the KJV text is in the **public domain**.
  sha256 of the extracted text: `{text_sha256}`.
- **Licence of this model:** derived only from public-domain text; released with pagegate (Apache-2.0).
- **Training:** {stats['steps']} steps of {args.batch_size} x {args.seq_len} tokens, AdamW, cosine
  schedule (peak lr {args.lr}), bf16 autocast on 2 CPU cores, seed {args.seed}, {stats['minutes']:.1f} minutes.
  Final training loss {stats['train_loss']:.3f}, held-out loss {stats['val_loss']:.3f} (nats/token).
- **Chat:** `<|system|>`, `<|user|>`, `<|assistant|>` open a message, `<|end|>` closes it; the model
  ends its turn with `<|end|><|end_of_text|>`. The template adds no bos token: encode the rendered
  prompt with special tokens to prepend `<|begin_of_text|>`.
- **Reproduce:** `.venv/bin/python scripts/train_default_model.py` from the repository root.
""")


def save_folder(model: LlamaForCausalLM, tokenizer: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    (out / "model.safetensors").chmod(0o644)  # written 0600; package data must be world-readable
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.setdefault("rope_theta", 10000.0)  # flat key too, for loaders that predate rope_parameters
    config.setdefault("torch_dtype", "float32")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=[tokenizer.token_to_id(EOS), tokenizer.token_to_id(END)],
        pad_token_id=tokenizer.token_to_id(EOS),
        do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=128,
    ).save_pretrained(out)
    save_tokenizer(tokenizer, out)


@torch.no_grad()
def show_samples(model: LlamaForCausalLM, tokenizer: Tokenizer) -> None:
    model.eval()
    stops = [tokenizer.token_to_id(EOS), tokenizer.token_to_id(END)]
    chat = render_chat([{"role": "user", "content": "What does the Bible say about love?"}], True)
    for prompt, sample in [("And God said", False), ("In the beginning", True), (chat, True)]:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        torch.manual_seed(0)
        sampling = {"do_sample": True, "temperature": 0.8, "top_p": 0.95} if sample else {"do_sample": False}
        output = model.generate(ids, max_new_tokens=60, eos_token_id=stops, pad_token_id=stops[0], **sampling)
        text = tokenizer.decode(output[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
        print(f"--- {'sampled' if sample else 'greedy'}: {prompt!r}\n{text}\n", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=300)
    parser.add_argument("--chat-documents", type=int, default=5000)
    parser.add_argument("--train-minutes", type=float, default=22.0,
                        help="time budget: the schedule ends here if --steps has not been reached")
    parser.add_argument("--seed", type=int, default=1611)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)  # the ThreadTuner may drop to 1 while the machine is busy
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    text_path = fetch_kjv(args.data_dir)
    raw = text_path.read_bytes()
    text_sha256 = hashlib.sha256(raw).hexdigest()
    chapters = parse_chapters(raw.decode())
    held_out = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY == HELD_OUT_EVERY // 2]
    train_chapters = [c for i, c in enumerate(chapters) if i % HELD_OUT_EVERY != HELD_OUT_EVERY // 2]
    print(f"{text_path}: sha256 {text_sha256}, {len(chapters)} chapters "
          f"({sum(len(c.verses) for c in chapters)} verses), {len(held_out)} held out", flush=True)

    tokenizer = train_tokenizer([c.text for c in train_chapters])
    documents = [c.text for c in train_chapters]
    documents += [chat_document(train_chapters, rng) for _ in range(args.chat_documents)]
    rng.shuffle(documents)
    train_stream = encode_documents(tokenizer, documents)
    val_stream = encode_documents(tokenizer, [c.text for c in held_out])
    val_gen = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [sample_windows(val_stream, args.batch_size, args.seq_len, val_gen) for _ in range(8)]
    print(f"train stream {len(train_stream):,} tokens ({len(documents)} documents), "
          f"val stream {len(val_stream):,} tokens", flush=True)

    model = LlamaForCausalLM(make_config(tokenizer))
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params:,} parameters", flush=True)
    stats = train(model, train_stream, val_batches, args)
    print(f"done: {stats}", flush=True)

    save_folder(model, tokenizer, args.out)
    write_readme(args.out, stats, params, text_sha256, args)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.1f} MB)", flush=True)
    show_samples(model, tokenizer)


if __name__ == "__main__":
    sys.exit(main())
