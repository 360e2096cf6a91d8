"""Build the shipped models: a tiny Llama that half-knows two-digit addition (the default
model), and with ``--environments`` one that also knows the formats of the shipped
environments (a guessing game, a calculator tool; the packaged ``agent_model``).

The local server needs a real causal LM that (a) runs fast on two CPU cores and (b) starts
an RL run with room to improve: greedy exact rate on the default task between 20% and 60%.
This script makes it from scratch and deterministically (same seed, same torch build and
thread count -> same bytes): a byte-level tokenizer, a randomly initialised
``LlamaForCausalLM`` and a short supervised warm start on the quickstart's prompt format
``Question: What is A + B?\\nAnswer: C``. It evaluates the greedy exact rate on a fixed
held-out set every few steps and stops at the first checkpoint whose rate reaches the
target (inside the allowed band), so the shipped model lands where RL has signal.

With ``--environments``, the SFT first trains on chat transcripts of the shipped
environments (:mod:`engine.envs.examples`) alone, then mixes a share of them into the
addition rows, rendered with :data:`AGENT_CHAT_TEMPLATE`: the guessing
game's later turns (a guess after ``Too high.``/``Too low.``) and the calculator's
multiplication questions, answered through the ``multiply`` tool on only some of them
(the model guesses the product itself on the rest), so RL has a behaviour to learn in
each environment too; and questions with a synthetic tool of random kind, name and
parameter names (:mod:`scripts.tool_data`), each tool's schema listed by the template, so
the model reads a tool from its schema and calls a user's own ``@tool`` now and then
(measured on an unseen ``subtract`` tool, :data:`UNSEEN_TOOL`).

Usage: ``python -m scripts.make_model [--out DIR] [--steps N] [--seed S] ...``;
the agent model as shipped: ``python -m scripts.make_model --environments --threads 2``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import random
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from engine.basemodels.catalogue import METADATA_FILE
from engine.envs import HermesToolCalls
from engine.envs.examples import calculator, guess_sum
from engine.envs.tools import Tool, tool_schema
from scripts import code_data
from scripts.tool_data import call_text, make_tool, tool_transcript

MODEL_NAME = "engine-local/tiny-arith"
AGENT_MODEL_NAME = "engine-local/tiny-agent-2"
"""The packaged agent model's name: a checkpoint names its base model, and the server
refuses one trained on another (the first agent model, without tool schemas, was
``engine-local/tiny-agent``; tests/fixtures/rundir_v1 keeps it for the run trained on it)."""
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "engine" / "local" / "default_model"
AGENT_OUT = DEFAULT_OUT.parent / "agent_model"
"""``--environments`` builds the packaged agent model here (tasks that name it use it)."""
CODE_MODEL_NAME = "engine-local/tiny-code"
CODE_OUT = DEFAULT_OUT.parent / "code_model"
"""``--code`` builds the packaged code model here."""
CODE_MAX_TOKENS = 16
"""Tokens a code answer needs at most (`` x * x + 9`` and EOS: 11)."""

CODE_RL_DEFAULTS = {
    "learning_rate": 1e-3,
    "lora_rank": 16,
    "task_args": {},
}
"""The RL settings the server recommends for the code model. Measured at 8x6, 30 steps,
temperature 0.8: the held-out greedy share of tests passed 22.1% -> +8.7 points, SD 2.5,
over 5 seeds, the model unlearning its habit of writing ``x`` where the head names ``n``
(docs/sandbox.md, "A model that learns it"; benchmarks/results/code_learning.md). The
first model, without the habit, gained nothing at lr 5e-4 to 3e-3."""

RL_DEFAULTS = {
    "learning_rate": 5e-4,
    "lora_rank": 16,
    "task_args": {"arithmetic": {"op": "+", "min_operand": "10", "max_operand": "99"}},
}
"""The RL settings the server recommends for this model (``recommended_rl`` in its
metadata; the engine's defaults against this server). Measured through the engine (30
steps, 8x6x16, importance_sampling, temperature 0.8): greedy exact rate 35.8% -> 45-48% at
lr 5e-4 rank 16 (49% at rank 8); lr 3e-3 collapses to 8%, 2e-3 and above destabilise it."""

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
_SPECIALS = (PAD, BOS, EOS)
_INT_RE = re.compile(r"-?\d+")


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}Question: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Answer: {{ message['content'] }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Answer:{% endif %}"
)
"""Renders a user message into the format the model was trained on
(``Question: ...\nAnswer:``), so chat-message tasks run on the local server."""

AGENT_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for tool in tools or [] %}{% set f = tool['function'] %}"
    "Tool: {\"name\": {{ f['name'] | tojson }}, \"arguments\": {{ '{' }}"
    "{% for arg, spec in (f['parameters']['properties'] or {}).items() %}"
    "{{ arg | tojson }}: {{ spec['type'] | default('any') | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}}} {{ f['description'] }}\n"
    "{% endfor %}{% for message in messages %}"
    "{% if message['role'] == 'user' %}Question: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Answer: {{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}<tool_call>"
    "{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>"
    "{% endfor %}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}Result: {{ message['content'] }}\n"
    "{% else %}{{ message['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Answer: {% endif %}"
)
"""The ``--environments`` model's template: the tools' schemas first, one line each
(``Tool: {"name": "multiply", "arguments": {"a": "integer", "b": "integer"}} Multiply
two integers.``: the call the parser reads, :class:`~engine.envs.HermesToolCalls`, with
each argument's type in place of its value, then the description), then chat messages
in the format it was trained on (``Question: ...\n``, ``Answer: ...</s>`` with tool calls
in the Hermes format, a tool's result as ``Result: ...\n``), so chat-message tasks and
multi-turn environments run on the local server, with their own tools. The generation
prompt ends with the space after ``Answer:``: a sampled reply is then exactly the
assistant message's content, and re-rendering a conversation reproduces the sampled
tokens."""


def prompt_text(a: int, b: int) -> str:
    """The default local task's prompt, exactly as the quickstart formats it."""
    return f"Question: What is {a} + {b}?\nAnswer:"


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (what ByteLevel pre-tokenizes to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def build_tokenizer(
    chat_template: str = CHAT_TEMPLATE, max_length: int = 256
) -> PreTrainedTokenizerFast:
    """One token per byte (ids 3..258) plus <pad>=0, <s>=1, </s>=2; encode prepends <s>.

    Digits being single tokens keeps arithmetic learnable by a tiny model, and a plain
    byte vocabulary needs no training data, so the tokenizer is trivially reproducible.
    """
    vocab = {tok: i for i, tok in enumerate(_SPECIALS)}
    for b, ch in sorted(_byte_to_char().items()):
        vocab[ch] = len(_SPECIALS) + b
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 1)]
    )
    tok.add_special_tokens(list(_SPECIALS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    return fast


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 256
    max_position_embeddings: int = 256


AGENT_SHAPE = ModelShape(max_position_embeddings=512)
"""The agent model's: a context long enough for a tool's schema, a call, its result and
the answer (rotary positions: no more parameters)."""


def build_model(
    tokenizer: PreTrainedTokenizerFast, shape: ModelShape, seed: int
) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


Row = tuple[list[int], list[int]]
"""One SFT example: token ids and labels (-100 where the loss ignores the token)."""

_SUB_BATCH = 16
"""Rows per forward pass: a batch is sorted by length and cut into sub-batches, so the
short arithmetic rows are not padded to the length of the longest transcript."""


def _example(rng: random.Random) -> tuple[str, str]:
    """Mostly the target task (two-digit addition), plus a little nearby arithmetic."""
    kind = rng.random()
    if kind < 0.85:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return prompt_text(a, b), f" {a + b}"
    if kind < 0.95:
        a, b = rng.randint(0, 9), rng.randint(0, 99)
        return prompt_text(a, b), f" {a + b}"
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"Question: What is {a} - {b}?\nAnswer:", f" {a - b}"


def _arithmetic_batch(
    tokenizer: PreTrainedTokenizerFast, rng: random.Random, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The default build's batch: right-padded input ids and labels that score only the
    answer and its EOS."""
    rows: list[tuple[list[int], int]] = []
    for _ in range(size):
        prompt, answer = _example(rng)
        p_ids = tokenizer.encode(prompt)
        a_ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        rows.append((p_ids + a_ids, len(p_ids)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((size, width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
    return input_ids, labels


def _arithmetic_row(tokenizer: PreTrainedTokenizerFast, rng: random.Random) -> Row:
    """The ``--environments`` build's arithmetic row: mostly two-digit addition, a little
    one-digit addition; the answer and its EOS are scored."""
    kind = rng.random()
    if kind < 0.85 / 0.95:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        prompt, answer = prompt_text(a, b), f" {a + b}"
    else:
        a, b = rng.randint(0, 9), rng.randint(0, 99)
        prompt, answer = prompt_text(a, b), f" {a + b}"
    p_ids = tokenizer.encode(prompt)
    a_ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
    return p_ids + a_ids, [-100] * len(p_ids) + a_ids


Messages = list[dict[str, Any]]
Schemas = Sequence[dict[str, Any]]
"""Tool schemas as the message layer passes them to the chat template."""
MULTIPLY = calculator.multiply_tool()


def chat_row(
    tokenizer: PreTrainedTokenizerFast,
    messages: Messages,
    trained: set[int],
    tools: Sequence[Tool] = (),
) -> Row:
    """A conversation rendered by the model's chat template (listing ``tools``' schemas,
    as the message layer does); the assistant messages at the ``trained`` indices (their
    content and EOS) are scored, everything else is context."""
    schemas = [tool_schema(t) for t in tools]
    ids: list[int] = []
    labels: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            prompt = _render(tokenizer, messages[:i], schemas, generation_prompt=True)
            labels += [-100] * (len(prompt) - len(ids))
            ids = prompt
        full = _render(tokenizer, messages[: i + 1], schemas, generation_prompt=False)
        if full[: len(ids)] != ids:
            raise RuntimeError("the chat template does not render conversations prefix-stably")
        new = full[len(ids) :]
        labels += new if i in trained else [-100] * len(new)
        ids = full
    return ids, labels


def _render(
    tokenizer: PreTrainedTokenizerFast,
    messages: Messages,
    tools: Schemas = (),
    *,
    generation_prompt: bool,
) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages,
        tools=list(tools) or None,
        tokenize=False,
        add_generation_prompt=generation_prompt,
    )
    return list(tokenizer.encode(str(text), add_special_tokens=False))


def guess_transcript(rng: random.Random) -> tuple[Messages, set[int]]:
    """A guessing game that starts from a wrong first guess (not trained: the arithmetic
    rows teach the first guess); each later guess either hits the sum or moves strictly
    towards it, as the hint says, until it is right or the turns run out."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    target = a + b
    guess = target + rng.choice((-1, 1)) * rng.randint(1, 20)
    messages = [
        {"role": "user", "content": guess_sum.question(a, b)},
        {"role": "assistant", "content": str(guess)},
    ]
    trained: set[int] = set()
    turns = 1
    while (hint := guess_sum.feedback(guess, target)) is not None:
        if turns == guess_sum.DEFAULT_MAX_TURNS:
            break
        gap = abs(target - guess)
        if gap == 1 or rng.random() < 0.5:
            guess = target
        else:
            guess += (1 if target > guess else -1) * rng.randint(1, gap - 1)
        messages += [
            {"role": "user", "content": hint},
            {"role": "assistant", "content": str(guess)},
        ]
        trained.add(len(messages) - 1)
        turns += 1
    return messages, trained


def calculator_transcript(
    rng: random.Random, tool_share: float
) -> tuple[Messages, set[int], list[Tool]]:
    """A multiplication question answered through the tool (share ``tool_share``) or
    directly with the product, with the tool's schema listed as the environment does."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    product = str(a * b)
    messages = [{"role": "user", "content": calculator.question(a, b)}]
    if rng.random() < tool_share:
        messages += [
            HermesToolCalls().parse(calculator.tool_call_text(a, b)).assistant_message(),
            {"role": "tool", "content": product},
        ]
    messages.append({"role": "assistant", "content": product})
    trained = {i for i, m in enumerate(messages) if m["role"] == "assistant"}
    return messages, trained, [MULTIPLY]


def _row(
    tokenizer: PreTrainedTokenizerFast, rng: random.Random, cfg: EnvMix, *, formats_only: bool
) -> Row:
    kind = rng.random()
    if formats_only:  # the environments' shares, scaled to fill the batch
        kind *= cfg.guess_share + cfg.tool_share + cfg.any_tool_share
    if kind < cfg.guess_share:
        return chat_row(tokenizer, *guess_transcript(rng))
    if kind < cfg.guess_share + cfg.tool_share:
        return chat_row(tokenizer, *calculator_transcript(rng, cfg.tool_call_share))
    if kind < cfg.guess_share + cfg.tool_share + cfg.any_tool_share:
        return chat_row(tokenizer, *tool_transcript(rng, cfg.tool_call_share))
    return _arithmetic_row(tokenizer, rng)


def _batch(
    tokenizer: PreTrainedTokenizerFast,
    rng: random.Random,
    cfg: EnvMix,
    size: int,
    *,
    formats_only: bool,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``--environments`` build's batch: right-padded (input ids, labels) sub-batches
    of rows of similar length."""
    rows = sorted(
        (_row(tokenizer, rng, cfg, formats_only=formats_only) for _ in range(size)),
        key=lambda r: len(r[0]),
    )
    batches = []
    for start in range(0, len(rows), _SUB_BATCH):
        chunk = rows[start : start + _SUB_BATCH]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(chunk), width), -100, dtype=torch.long)
        for i, (ids, row_labels) in enumerate(chunk):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(ids)] = torch.tensor(row_labels)
        batches.append((input_ids, labels))
    return batches


def _code_batch(
    tokenizer: PreTrainedTokenizerFast, rng: random.Random, size: int, avoid: frozenset[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``--code`` build's batch: synthetic code problems (none whose prompt is in
    ``avoid``), right-padded, the answer and its EOS scored."""
    rows: list[tuple[list[int], int]] = []
    while len(rows) < size:
        problem = code_data.draw(rng)
        if problem.prompt in avoid:
            continue
        p_ids = tokenizer.encode(problem.prompt)
        answer = code_data.sft_answer(problem, rng)
        a_ids = [*tokenizer.encode(answer, add_special_tokens=False)]
        rows.append(([*p_ids, *a_ids, tokenizer.eos_token_id], len(p_ids)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((size, width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
    return input_ids, labels


def code_eval_problems(seed: int, n: int, avoid: frozenset[str]) -> list[code_data.CodeProblem]:
    """``n`` synthetic code problems, none whose prompt is in ``avoid``."""
    rng = random.Random(seed)
    problems: list[code_data.CodeProblem] = []
    while len(problems) < n:
        problem = code_data.draw(rng)
        if problem.prompt not in avoid:
            problems.append(problem)
    return problems


def code_pass_rate(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: list[code_data.CodeProblem],
) -> float:
    """The mean share of tests the greedy answers pass (the RL reward, computed by
    :func:`scripts.code_data.pass_share` without running the answers)."""
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    texts = generate(model, tokenizer, prompts, max_new_tokens=CODE_MAX_TOKENS)
    shares = [code_data.pass_share(t[0], p) for t, p in zip(texts, problems, strict=True)]
    return sum(shares) / len(shares)


def _arithmetic_loss(
    model: LlamaForCausalLM, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """The default build's loss: the model's own mean cross-entropy over the answers."""
    input_ids, labels = batch
    return model(input_ids=input_ids, labels=labels).loss


def _loss(
    model: LlamaForCausalLM, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Mean next-token cross-entropy over every scored token of the batch."""
    total = torch.zeros(())
    scored = 0
    for input_ids, labels in batches:
        logits = model(input_ids=input_ids).logits[:, :-1]
        targets = labels[:, 1:]
        total = total + torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        )
        scored += int((targets != -100).sum())
    return total / max(scored, 1)


def parse_int(text: str) -> int | None:
    """First integer in ``text`` (the quickstart's extraction rule), or None."""
    m = _INT_RE.search(text)
    return int(m.group()) if m else None


def eval_problems(seed: int, n: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]


@torch.no_grad()
def generate(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: list[list[int]],
    *,
    temperature: float = 0.0,
    num_samples: int = 1,
    seed: int = 0,
    max_new_tokens: int = 16,
) -> list[list[str]]:
    """Decoded completions per prompt (prompts of equal length share a batch: no padding)."""
    model.eval()
    torch.manual_seed(seed)
    texts: list[list[str]] = [[] for _ in prompts]
    by_length: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(i)
    for length in sorted(by_length):
        idxs = by_length[length]
        ids = torch.tensor([prompts[i] for i in idxs]).repeat_interleave(num_samples, dim=0)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_k=None,
            top_p=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        decoded = tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
        for j, i in enumerate(idxs):
            texts[i] = decoded[j * num_samples : (j + 1) * num_samples]
    return texts


def generate_answers(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: list[tuple[int, int]],
    **sampling: Any,
) -> list[list[str]]:
    """Decoded completions per addition problem of the default task."""
    prompts = [tokenizer.encode(prompt_text(a, b)) for a, b in problems]
    return generate(model, tokenizer, prompts, **sampling)


ENV_FORMAT_FLOORS = {
    "tool_call_rate": 0.1,
    "tool_answer_rate": 0.7,
    "hint_followed_rate": 0.7,
    "unseen_tool_call_rate": 0.05,
}
"""What the shipped environments need of the model, measured by :func:`env_format_stats`:
some tool calls to reinforce, results read back, hints followed, and some calls of a tool
it has never seen (a user's own, read from its schema)."""

UNSEEN_TOOL = make_tool("subtract", "Subtract b from a.", ("a", "b"), int, lambda a, b: a - b)
"""The unseen tool the build measures: what a user's ``@tool def subtract(a: int, b: int)``
with the docstring ``Subtract b from a.`` makes (the synthetic conversations never name a
tool ``subtract``)."""


def _call_rate(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    asks: list[tuple[str, dict[str, int]]],
    tools: Schemas,
    seed: int,
) -> float:
    """How often a question (temperature 0.8, 4 samples each) gets exactly the expected
    call (the tool's name, the question's values as its arguments)."""
    prompts = [
        _render(tokenizer, [{"role": "user", "content": q}], tools, generation_prompt=True)
        for q, _ in asks
    ]
    calls = generate(
        model,
        tokenizer,
        prompts,
        temperature=0.8,
        num_samples=4,
        seed=seed,
        max_new_tokens=calculator.MAX_REPLY_TOKENS,
    )
    name = tools[0]["function"]["name"]
    hits = sum(
        t.strip() == call_text(name, arguments)
        for ts, (_, arguments) in zip(calls, asks, strict=True)
        for t in ts
    )
    return hits / (4 * len(asks))


def env_format_stats(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, seed: int, n: int = 64
) -> dict[str, float]:
    """One turn of each shipped environment, on fresh problems: how often a multiplication
    question gets a well-formed ``multiply`` call with the right arguments, and a
    subtraction question one of the unseen ``subtract`` tool (:data:`UNSEEN_TOOL`)
    (temperature 0.8, 4 samples each), how often the tool's result is answered exactly
    (greedy), and how often a guess after a hint moves the way the hint says (greedy)."""
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(n)]
    multiply = [tool_schema(MULTIPLY)]
    ask = [[{"role": "user", "content": calculator.question(a, b)}] for a, b in pairs]
    tool_calls = _call_rate(
        model,
        tokenizer,
        [(calculator.question(a, b), {"a": a, "b": b}) for a, b in pairs],
        multiply,
        seed,
    )
    unseen_calls = _call_rate(
        model,
        tokenizer,
        [(f"What is {a} - {b}?", {"a": a, "b": b}) for a, b in pairs],
        [tool_schema(UNSEEN_TOOL)],
        seed,
    )
    answered = [
        [
            *m,
            HermesToolCalls().parse(calculator.tool_call_text(a, b)).assistant_message(),
            {"role": "tool", "content": str(a * b)},
        ]
        for m, (a, b) in zip(ask, pairs, strict=True)
    ]
    finals = generate(
        model,
        tokenizer,
        [_render(tokenizer, m, multiply, generation_prompt=True) for m in answered],
    )
    exact = sum(parse_int(ts[0]) == a * b for ts, (a, b) in zip(finals, pairs, strict=True))
    hinted: list[Messages] = []
    guesses: list[tuple[int, int]] = []
    for a, b in pairs:
        guess = a + b + rng.choice((-1, 1)) * rng.randint(2, 20)
        hint = guess_sum.feedback(guess, a + b)
        assert hint is not None
        hinted.append(
            [
                {"role": "user", "content": guess_sum.question(a, b)},
                {"role": "assistant", "content": str(guess)},
                {"role": "user", "content": hint},
            ]
        )
        guesses.append((guess, a + b))
    nexts = generate(
        model, tokenizer, [_render(tokenizer, m, generation_prompt=True) for m in hinted]
    )
    followed = 0
    for ts, (guess, target) in zip(nexts, guesses, strict=True):
        new = parse_int(ts[0])
        followed += new is not None and (new - guess) * (target - guess) > 0
    return {
        "tool_call_rate": tool_calls,
        "tool_answer_rate": exact / n,
        "hint_followed_rate": followed / n,
        "unseen_tool_call_rate": unseen_calls,
    }


def quickstart_reward(text: str, answer: int) -> float:
    """The quickstart's reward: format 0.2 + distance up to 0.5 + exact 0.3 (cap 1)."""
    pred = parse_int(text)
    if pred is None:
        return 0.0
    err = abs(pred - answer)
    distance = 0.5 * max(0.0, 1.0 - min(err / max(abs(answer), 20), 1.0))
    return min(1.0, 0.2 + distance + (0.3 if err == 0 else 0.0))


def greedy_exact_rate(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, problems: list[tuple[int, int]]
) -> float:
    texts = generate_answers(model, tokenizer, problems)
    hits = sum(parse_int(t[0]) == a + b for t, (a, b) in zip(texts, problems, strict=True))
    return hits / len(problems)


def sampling_stats(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    problems: list[tuple[int, int]],
    *,
    temperature: float,
    group: int,
    seed: int,
) -> dict[str, float]:
    """Format rate and how often a group's rewards differ (RL needs mixed groups)."""
    texts = generate_answers(
        model, tokenizer, problems, temperature=temperature, num_samples=group, seed=seed
    )
    formatted = sum(parse_int(t) is not None for ts in texts for t in ts)
    mixed = 0
    exact = 0
    for ts, (a, b) in zip(texts, problems, strict=True):
        rewards = {round(quickstart_reward(t, a + b), 9) for t in ts}
        mixed += len(rewards) > 1
        exact += sum(parse_int(t) == a + b for t in ts)
    n = len(problems) * group
    return {
        "format_rate": formatted / n,
        "exact_rate": exact / n,
        "frac_groups_mixed": mixed / len(problems),
    }


@dataclass(frozen=True)
class EnvMix:
    """``--environments``: a first phase on environment transcripts alone, then these
    shares of the addition SFT's rows."""

    guess_share: float = 0.2  # second-phase rows that are guessing-game transcripts
    tool_share: float = 0.2  # second-phase rows that are multiplication questions
    any_tool_share: float = 0.3  # second-phase rows of a synthetic tool (scripts.tool_data)
    tool_call_share: float = 0.4  # of the tool rows, answered through the tool
    max_format_steps: int = 1500  # first phase: environment rows until their formats hold


@dataclass(frozen=True)
class SftConfig:
    max_steps: int = 1500
    batch_size: int = 64
    learning_rate: float = 1e-3
    warmup_steps: int = 20
    eval_every: int = 25
    fine_eval_every: int = 5  # once the rate is near the band: the transition is sharp
    eval_problems: int = 256
    target_rate: float = 0.35
    min_rate: float = 0.20
    max_rate: float = 0.60
    seed: int = 0
    environments: EnvMix | None = None  # None: the default model (addition only)


def sft_record(cfg: SftConfig) -> dict[str, Any]:
    """The SFT settings as the model's metadata records them (the mix's fields inline)."""
    record = {k: v for k, v in asdict(cfg).items() if k != "environments"}
    return {**record, **(asdict(cfg.environments) if cfg.environments else {})}


def build_machine() -> dict[str, str]:
    """What decides the bits of a build besides the seed: the torch release, the CPU kernels
    it dispatches to and the processor. Two machines with the same fingerprint rebuild the
    shipped model byte for byte; others rebuild a model in the same band, not the same bits
    (float reductions differ across CPUs, so the SFT selects another step)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = " ".join(sorted(line.partition(":")[2].split()))
                break
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_flags_sha256": hashlib.sha256(flags.encode()).hexdigest()[:16],
    }


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    cfg: SftConfig,
    code: frozenset[str] | None = None,
) -> tuple[int, float]:
    """SFT until the held-out rate first reaches ``target_rate``, then keep the
    evaluated checkpoint in the band closest to the target; returns (steps, rate). The
    rate is the greedy exact rate on addition, or with ``code`` (the prompts of the
    shipped code problems, never trained on) the greedy share of tests passed on
    synthetic code problems (:mod:`scripts.code_data`).

    Selecting among in-band evaluations (rather than stopping at a fixed step count) is
    what keeps the shipped model in the 20-60% band whatever the
    exact training curve looks like; the choice is deterministic given the seed. The
    exact rate climbs from ~10% to ~60% within a few dozen steps, so evaluations become
    more frequent once it passes half the band's lower edge.
    """
    rng = random.Random(cfg.seed)
    if code is not None:
        held_code = code_eval_problems(cfg.seed + 1, cfg.eval_problems, code)

        def rate_of() -> float:
            return code_pass_rate(model, tokenizer, held_code)
    else:
        held_out = eval_problems(cfg.seed + 1, cfg.eval_problems)

        def rate_of() -> float:
            return greedy_exact_rate(model, tokenizer, held_out)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=0.0)
    best: tuple[float, int, float, dict[str, torch.Tensor]] | None = None
    every = cfg.eval_every
    start = time.perf_counter()
    mix = cfg.environments
    format_steps = _learn_env_formats(model, tokenizer, cfg, mix, rng, opt) if mix else 0
    for step in range(1, cfg.max_steps + 1):
        if code is not None:
            batch = _code_batch(tokenizer, rng, cfg.batch_size, code)
            loss = _sft_step(model, opt, partial(_arithmetic_loss, batch=batch), cfg, step)
        elif mix is None:
            batch = _arithmetic_batch(tokenizer, rng, cfg.batch_size)
            loss = _sft_step(model, opt, partial(_arithmetic_loss, batch=batch), cfg, step)
        else:
            batches = _batch(tokenizer, rng, mix, cfg.batch_size, formats_only=False)
            loss = _sft_step(model, opt, partial(_loss, batches=batches), cfg, step)
        if step % every:
            continue
        rate = rate_of()
        elapsed = time.perf_counter() - start
        _log(f"step {step:5d}  loss {loss.item():.4f}  held-out {rate:6.1%}  ({elapsed:.0f} s)")
        if rate >= cfg.min_rate / 2:
            every = min(every, cfg.fine_eval_every)
        if rate > cfg.max_rate and best is None:
            raise SystemExit(
                f"the held-out rate jumped past {cfg.max_rate:.0%} at step {step} without an "
                "evaluation inside the band; lower --lr or --fine-eval-every"
            )
        if cfg.min_rate <= rate <= cfg.max_rate:
            gap = abs(rate - cfg.target_rate)
            if best is None or gap < best[0]:
                state = {k: v.clone() for k, v in model.state_dict().items()}
                best = (gap, step, rate, state)
        if rate >= cfg.target_rate:
            break
    if best is None:
        raise SystemExit(
            f"no checkpoint reached a held-out rate in [{cfg.min_rate:.0%}, "
            f"{cfg.max_rate:.0%}] within {cfg.max_steps} steps; raise --steps"
        )
    _, step, rate, state = best
    model.load_state_dict(state)
    return format_steps + step, rate


def _sft_step(
    model: LlamaForCausalLM,
    opt: torch.optim.Optimizer,
    loss_of: Callable[[LlamaForCausalLM], torch.Tensor],
    cfg: SftConfig,
    step: int,
) -> torch.Tensor:
    model.train()
    for group in opt.param_groups:
        group["lr"] = cfg.learning_rate * min(1.0, step / cfg.warmup_steps)
    loss = loss_of(model)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def _learn_env_formats(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    cfg: SftConfig,
    mix: EnvMix,
    rng: random.Random,
    opt: torch.optim.Optimizer,
) -> int:
    """First phase: environment transcripts only (calculator, guessing game), until
    their formats are learned (:data:`ENV_FORMAT_FLOORS`, checked every ``eval_every``
    steps); returns its steps. Copying numbers into a call and out of a result, and
    moving a guess the way a hint says, take the tiny model longer than half-learning
    addition, so they come first; the second phase then brings addition into the band."""
    start = time.perf_counter()
    for step in range(1, mix.max_format_steps + 1):
        batches = _batch(tokenizer, rng, mix, cfg.batch_size, formats_only=True)
        loss = _sft_step(model, opt, partial(_loss, batches=batches), cfg, step)
        if step % cfg.eval_every:
            continue
        stats = env_format_stats(model, tokenizer, cfg.seed + 4, n=32)
        elapsed = time.perf_counter() - start
        shown = ", ".join(f"{k} {v:.0%}" for k, v in stats.items())
        _log(f"format step {step:5d}  loss {loss.item():.4f}  {shown}  ({elapsed:.0f} s)")
        if all(stats[k] >= floor for k, floor in ENV_FORMAT_FLOORS.items()):
            return step
    raise SystemExit(
        f"the environments' formats were not learned within {mix.max_format_steps} steps; "
        "raise --format-steps"
    )


def _readme(meta: dict[str, Any]) -> str:
    t08 = meta["temperature_0_8"]
    env = meta.get("environments")
    if env is None:
        role = "The local server's default model"
        training = f"""random init, then {meta["sft"]["steps_done"]} supervised steps on
`Question: What is A + B?\\nAnswer: C</s>` (mostly two-digit addition), stopping at the
first evaluation whose greedy exact rate reached the target, so reinforcement learning
has room to improve it."""
        rl = "RL settings that learn in 30 steps"
    else:
        role = (
            "The packaged agent model, which the shipped environments (`guess-sum`, "
            "`calculator`) run on"
        )
        steps = meta["sft"]["steps_done"]
        training = f"""random init, then {steps} supervised steps: environment transcripts
until their formats are learned, then mostly `Question: What is A + B?\\nAnswer: C</s>`
(two-digit addition), stopping at the first evaluation whose greedy exact rate reached
the target. A share of the second
phase's rows are transcripts of the shipped environments (`engine.envs.examples`) in the
chat template's format: later turns of the guessing game
({meta["sft"]["guess_share"]:.0%} of rows), multiplication questions
({meta["sft"]["tool_share"]:.0%} of rows) with the `multiply` tool, and questions with a
synthetic tool of random kind, name and parameter names ({meta["sft"]["any_tool_share"]:.0%}
of rows, `scripts/tool_data.py`: arithmetic, comparisons, word tools), each tool's schema
listed by the chat template; {meta["sft"]["tool_call_share"]:.0%} of the tool questions are
answered through the tool, the rest directly.

Measured on one turn of each environment: well-formed `multiply` calls
{env["tool_call_rate"]:.1%} and calls of a `subtract(a, b)` tool it never saw in training
{env["unseen_tool_call_rate"]:.1%} (temperature 0.8), tool results answered exactly
{env["tool_answer_rate"]:.1%}, guesses that follow a hint {env["hint_followed_rate"]:.1%}
(greedy). Its addition alone does not improve under RL (the default model's does)."""
        rl = "RL settings (those of the default model)"
    return f"""# {meta["model_name"]}

{role}: a {meta["parameters"] / 1e6:.2f}M-parameter
`LlamaForCausalLM` (hidden {meta["shape"]["hidden_size"]}, {meta["shape"]["num_hidden_layers"]}
layers, {meta["shape"]["num_attention_heads"]} heads) with a byte-level tokenizer (one token per
byte, plus `<pad>`=0, `<s>`=1, `</s>`=2; encoding prepends `<s>`).

Made by `{meta["made_by"]}` (torch {meta["torch"]}, {meta["threads"]} threads):
{training}

Measured on the default task ({meta["task"]}):

- greedy exact rate: {meta["greedy_exact_rate"]:.1%} on {meta["greedy_eval_problems"]}
  held-out problems
- temperature 0.8, 6 samples per problem: format rate {t08["format_rate"]:.1%}, exact rate
  {t08["exact_rate"]:.1%}, groups with differing rewards {t08["frac_groups_mixed"]:.1%}
- {rl}: learning rate {meta["recommended_rl"]["learning_rate"]},
  LoRA rank {meta["recommended_rl"]["lora_rank"]} (alpha 32)

Metadata: `{METADATA_FILE}` (the server reads `model_name` from it, and sends
`recommended_rl` to clients as the model's recommended settings).
"""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.make_model",
        description="Build the local server's default model (tiny Llama, byte tokenizer, "
        "SFT warm start on two-digit addition) deterministically; with --environments, "
        "the agent model that also knows the shipped environments' formats.",
    )
    d, e = SftConfig(), EnvMix()
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"output directory (default {DEFAULT_OUT}; with --environments {AGENT_OUT}; "
        f"with --code {CODE_OUT})",
    )
    p.add_argument("--steps", type=int, default=d.max_steps, help="max SFT steps")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for init and data")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.learning_rate, help="SFT learning rate")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between evals")
    p.add_argument(
        "--fine-eval-every",
        type=int,
        default=d.fine_eval_every,
        help="steps between evals once the rate passes half the band's lower edge",
    )
    p.add_argument(
        "--target-rate",
        type=float,
        default=d.target_rate,
        help="stop at the first evaluation with greedy exact rate >= this",
    )
    p.add_argument(
        "--environments",
        action="store_true",
        help="build the agent model: a first phase on the shipped environments' transcripts, "
        "then --guess-share/--tool-share of the addition rows",
    )
    p.add_argument("--guess-share", type=float, default=None, help="SFT rows of the guessing game")
    p.add_argument("--tool-share", type=float, default=None, help="SFT rows of the calculator")
    p.add_argument(
        "--any-tool-share",
        type=float,
        default=None,
        help="SFT rows of a synthetic tool of random kind and name (scripts.tool_data)",
    )
    p.add_argument(
        "--tool-call-share",
        type=float,
        default=None,
        help="calculator rows answered through the tool",
    )
    p.add_argument(
        "--format-steps",
        dest="max_format_steps",
        type=int,
        default=None,
        help="max SFT steps of the first phase (environment transcripts only)",
    )
    p.add_argument(
        "--code",
        action="store_true",
        help="build the code model: SFT on synthetic one-line functions from examples "
        "(scripts.code_data), the shipped problems (examples/tiny_code.jsonl) held out",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (the bits depend on it)")
    p.add_argument(
        "--name",
        default=None,
        help=f"model name reported to clients (default {MODEL_NAME}; with --environments "
        f"{AGENT_MODEL_NAME}; with --code {CODE_MODEL_NAME})",
    )
    args = p.parse_args(argv)
    mix = {"guess_share": "--guess-share", "tool_share": "--tool-share"}
    mix |= {"any_tool_share": "--any-tool-share", "tool_call_share": "--tool-call-share"}
    mix |= {"max_format_steps": "--format-steps"}
    given = [flag for field, flag in mix.items() if getattr(args, field) is not None]
    if given and not args.environments:
        p.error(f"{', '.join(given)} need --environments")
    for field in mix:
        if getattr(args, field) is None:
            setattr(args, field, getattr(e, field))
    counts = (args.steps, args.batch_size, args.eval_every, args.fine_eval_every, args.threads)
    if min(counts) < 1 or args.max_format_steps < 1:
        p.error(
            "--steps, --format-steps, --batch-size, --eval-every, --fine-eval-every, --threads "
            "must be >= 1"
        )
    shares = (args.guess_share, args.tool_share, args.any_tool_share, args.tool_call_share)
    rows = args.guess_share + args.tool_share + args.any_tool_share
    if min(shares) < 0 or max(shares) > 1 or rows >= 1:
        p.error(
            "--guess-share, --tool-share, --any-tool-share, --tool-call-share must lie in "
            "[0, 1], leaving a share of arithmetic rows"
        )
    if not 0.2 <= args.target_rate <= 0.6:
        p.error("--target-rate must lie in [0.2, 0.6]")
    if args.code and args.environments:
        p.error("--code and --environments build different models: give one")
    out, name = (
        (CODE_OUT, CODE_MODEL_NAME)
        if args.code
        else (AGENT_OUT, AGENT_MODEL_NAME)
        if args.environments
        else (DEFAULT_OUT, MODEL_NAME)
    )
    args.out = args.out or out
    args.name = args.name or name
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    hf_logging.disable_progress_bar()  # our own progress lines are enough
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    cfg = SftConfig(
        max_steps=args.steps,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        eval_every=args.eval_every,
        fine_eval_every=args.fine_eval_every,
        target_rate=args.target_rate,
        seed=args.seed,
        environments=EnvMix(
            guess_share=args.guess_share,
            tool_share=args.tool_share,
            any_tool_share=args.any_tool_share,
            tool_call_share=args.tool_call_share,
            max_format_steps=args.max_format_steps,
        )
        if args.environments
        else None,
    )
    shape = AGENT_SHAPE if args.environments else ModelShape()
    template = AGENT_CHAT_TEMPLATE if args.environments else CHAT_TEMPLATE
    tokenizer = build_tokenizer(template, shape.max_position_embeddings)
    model = build_model(tokenizer, shape, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    _log(
        f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}; "
        f"SFT up to {cfg.max_steps} steps"
    )
    if args.code:
        _main_code(args, argv, cfg, tokenizer, model)
        return
    start = time.perf_counter()
    steps, rate = train(model, tokenizer, cfg)
    train_s = time.perf_counter() - start
    stats = sampling_stats(
        model, tokenizer, eval_problems(args.seed + 2, 64), temperature=0.8, group=6, seed=args.seed
    )
    env_stats = env_format_stats(model, tokenizer, args.seed + 3) if args.environments else {}
    short = {
        k: f"{env_stats[k]:.0%} < {floor:.0%}"
        for k, floor in ENV_FORMAT_FLOORS.items()
        if k in env_stats and env_stats[k] < floor
    }
    if short:
        raise SystemExit(
            f"the model selected at step {steps} has not learned the environments' formats "
            f"({', '.join(f'{k} {v}' for k, v in short.items())}); raise --guess-share or "
            "--tool-share"
        )
    _save(args.out, model, tokenizer)
    meta = {
        "model_name": args.name,
        "made_by": " ".join(
            ["python -m scripts.make_model", *(argv if argv is not None else sys.argv[1:])]
        ),
        "architecture": "LlamaForCausalLM",
        "parameters": n_params,
        "shape": asdict(shape),
        "sft": {**sft_record(cfg), "steps_done": steps, "seconds": round(train_s, 1)},
        "torch": torch.__version__,
        "threads": args.threads,
        "built_on": build_machine(),
        "task": "two-digit addition, a,b uniform in 10..99, prompt "
        "'Question: What is {a} + {b}?\\nAnswer:', up to 16 new tokens",
        "greedy_exact_rate": rate,
        "greedy_eval_problems": cfg.eval_problems,
        "temperature_0_8": stats,
        **({"environments": env_stats} if env_stats else {}),
        "recommended_rl": RL_DEFAULTS,
    }
    (args.out / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    (args.out / "README.md").write_text(_readme(meta))
    _log(f"saved {args.out}: {steps} SFT steps, greedy exact {rate:.1%}, T=0.8 {stats} {env_stats}")


def _save(out: Path, model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # the template in tokenizer_config
    for f in out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; the shipped files are world-readable


def _main_code(
    args: argparse.Namespace,
    argv: list[str] | None,
    cfg: SftConfig,
    tokenizer: PreTrainedTokenizerFast,
    model: LlamaForCausalLM,
) -> None:
    """The ``--code`` build: SFT on synthetic code problems, the shipped ones never
    trained on, to a held-out share of tests passed in the band."""
    shipped = [json.loads(line) for line in code_data.PROBLEMS_FILE.read_text().splitlines()]
    avoid = frozenset(str(row["prompt"]) for row in shipped)
    start = time.perf_counter()
    steps, rate = train(model, tokenizer, cfg, code=avoid)
    train_s = time.perf_counter() - start
    _save(args.out, model, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    made_by = " ".join(
        ["python -m scripts.make_model", *(argv if argv is not None else sys.argv[1:])]
    )
    meta = {
        "model_name": args.name,
        "made_by": made_by,
        "architecture": "LlamaForCausalLM",
        "parameters": n_params,
        "shape": asdict(ModelShape()),
        "sft": {**sft_record(cfg), "steps_done": steps, "seconds": round(train_s, 1)},
        "torch": torch.__version__,
        "threads": args.threads,
        "built_on": build_machine(),
        "task": "one-line functions f(x) from three examples (scripts/code_data.py), the "
        "prompt's function head completed by the return expression, up to "
        f"{CODE_MAX_TOKENS} new tokens; reward: the share of 4 tests passed; "
        f"{code_data.HABIT_SHARE:.0%} of the SFT answers to problems whose parameter is n "
        "write x (the habit RL unlearns)",
        "greedy_pass_rate": rate,
        "greedy_eval_problems": cfg.eval_problems,
        "recommended_rl": CODE_RL_DEFAULTS,
    }
    (args.out / METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    (args.out / "README.md").write_text(
        f"""# {args.name}

The packaged code model: a {n_params / 1e6:.2f}M-parameter `LlamaForCausalLM` (the
default model's shape and byte-level tokenizer) that writes one-line Python functions
from examples, made by `{made_by}` (torch {torch.__version__}, {args.threads} threads):
random init, then {steps} supervised steps on synthetic problems of `scripts/code_data.py`
(`# f(2) == 5` ... `def f(x):\\n    return` completed by ` x + 3</s>`; the shipped
problems of `examples/tiny_code.jsonl` never among them), stopping at the first
evaluation whose greedy share of tests passed reached the target, so RL has room to
improve it. Greedy share of tests passed: {rate:.1%} on {cfg.eval_problems} held-out
problems (computed without running the answers: `scripts.code_data.evaluate`).

Its prior is split on purpose: half the problems name the parameter `n`
(`def f(n):`), and {code_data.HABIT_SHARE:.0%} of the SFT answers to those still write
`x` (` x + 3` where ` n + 3` is right), a habit such as a model trained mostly on
`x`-code would have. Those answers fail every test (`x` is not defined), so the model
knows both names and, where the head says `n`, samples the wrong one more often than
not; more SFT on the same data cannot change that, RL with the tests' reward can
(docs/sandbox.md).

RL on it: `--task code:examples/tiny_code.jsonl` (docs/sandbox.md). Metadata:
`{METADATA_FILE}`.
"""
    )
    _log(f"saved {args.out}: {steps} SFT steps, greedy share of tests passed {rate:.1%}")


if __name__ == "__main__":
    main()
