"""Baseline for `serve_bench.py`: HF transformers `generate` behind the same streaming API.

What a team would run without an engine: one process, `model.generate`, requests served one
at a time (`--mode sequential`) or in static batches (`--mode static`: up to `--batch-size`
queued requests are left-padded into one `generate` call that runs until its longest request
is done). Tokens stream as they are produced, in the same SSE shape as kvfleet's
`/v1/completions`, so the benchmark client measures both servers identically.

    python bench/hf_baseline_server.py --port 8100 [--model X.gguf] [--mode static]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from kvfleet.engine.model.loader import default_model_path


class Body(BaseModel):
    prompt: list[int]
    max_tokens: int = 16
    stream: bool = True
    ignore_eos: bool = True


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    tokens: asyncio.Queue[int | None] = field(default_factory=asyncio.Queue)
    num_out: int = 0
    cancelled: bool = False  # the client went away: skip it, or stop its batch early

    def emit(self, token: int | None) -> None:
        self.loop.call_soon_threadsafe(self.tokens.put_nowait, token)


class _Fanout(BaseStreamer):
    """Routes each generated column to its job; a job ends at its own max_tokens."""

    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:  # generate() first streams the prompt
            self.seen_prompt = True
            return
        for job, token in zip(self.jobs, value.reshape(len(self.jobs), -1)[:, -1].tolist(),
                              strict=True):
            if job.num_out < job.max_tokens:
                job.num_out += 1
                job.emit(int(token))
                if job.num_out == job.max_tokens:
                    job.emit(None)

    def end(self) -> None:
        for job in self.jobs:
            if job.num_out < job.max_tokens:
                job.num_out = job.max_tokens
                job.emit(None)


class _AllCancelled(StoppingCriteria):
    def __init__(self, jobs: list[Job]) -> None:
        self.jobs = jobs

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> bool:
        return all(job.cancelled for job in self.jobs)


def worker(model: Any, jobs: queue.Queue[Job], mode: str, batch_size: int,
           batch_wait: float) -> None:
    torch.set_grad_enabled(False)
    while True:
        batch = [jobs.get()]
        if mode == "static":
            deadline = time.monotonic() + batch_wait
            while len(batch) < batch_size:
                try:
                    batch.append(jobs.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
        batch = [job for job in batch if not job.cancelled]
        if not batch:
            continue
        width = max(len(j.prompt) for j in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, job in enumerate(batch):
            ids[row, width - len(job.prompt):] = torch.tensor(job.prompt)
            mask[row, width - len(job.prompt):] = 1
        longest = max(j.max_tokens for j in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                       min_new_tokens=longest, do_sample=False, pad_token_id=0,
                       streamer=_Fanout(batch),
                       stopping_criteria=StoppingCriteriaList([_AllCancelled(batch)]))


def build_app(model: Any, mode: str, batch_size: int, batch_wait: float) -> FastAPI:
    app = FastAPI()
    jobs: queue.Queue[Job] = queue.Queue()
    threading.Thread(target=worker, args=(model, jobs, mode, batch_size, batch_wait),
                     daemon=True).start()

    @app.get("/ready")
    async def ready() -> dict[str, bool]:
        return {"ready": True}

    @app.post("/v1/completions")
    async def completions(body: Body) -> StreamingResponse:
        job = Job(body.prompt, body.max_tokens, asyncio.get_running_loop())
        jobs.put(job)

        async def events() -> AsyncIterator[str]:
            seq = 0
            try:
                while (token := await job.tokens.get()) is not None:
                    chunk = {"seq": seq,
                             "choices": [{"text": f"<{token}>", "finish_reason": None}]}
                    seq += 1
                    yield f"data: {json.dumps(chunk)}\n\n"
                final = {"seq": seq, "choices": [{"text": "", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": len(job.prompt),
                                   "completion_tokens": job.num_out}}
                yield f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n"
            finally:
                job.cancelled = job.num_out < job.max_tokens

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--mode", choices=["sequential", "static"], default="static")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batch-wait", type=float, default=0.05)
    args = parser.parse_args()
    path = args.model or default_model_path()
    model: Any = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                      dtype=torch.float32)
    model.eval()
    uvicorn.run(build_app(model, args.mode, args.batch_size, args.batch_wait),
                host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
