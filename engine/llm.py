"""`LLM`: the offline, vLLM-shaped entry point (`LLM(...).generate(prompts, params)`)."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as SequenceT
from typing import Any, cast

from engine.engine_config import EngineConfig
from engine.kv_connector import KVConnector, connector_env, resolve_kv_connector
from engine.llm_engine import LLMEngine, PromptType
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    """A paged engine over one local Llama-family checkpoint (None = the bundled default).

    Every keyword is an `EngineConfig` field (validated; errors name the key), plus the
    optional `kv_connector`: a connector object, or a connector config (tier URL or list of
    them, mapping, YAML path) built by the installed factory, e.g. `kv_connector=["cpu"]`.
    Left out (None), the connector is built from the environment when KVTIER_CONFIG,
    KVTIER_TIERS or LMCACHE_CONFIG_FILE is set (`kv_connector=True` asks for that always);
    `kv_connector=False` means no connector whatever the environment says.
    """

    def __init__(self, model: str | None = None, *, kv_connector: KVConnector | Any = None,
                 **kwargs: Any) -> None:
        if model is not None:
            model = str(model)
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        if kv_connector is None and connector_env():
            kv_connector = True  # the factory reads the environment
        connector, built = resolve_kv_connector(None if kv_connector is False else kv_connector)
        try:
            self.engine = LLMEngine(self.config, connector)
        except BaseException:
            if built and connector is not None:  # ours to close: its threads and connections must not outlive the error
                connector.shutdown()
            raise
        self._closed = False

    # ---- accessors ----
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Returns `messages` rendered with the checkpoint's chat template, ready to generate."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this checkpoint has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # ---- generation ----
    def generate(
        self,
        prompts: PromptType | SequenceT[PromptType],
        sampling_params: SamplingParams | SequenceT[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Returns one finished RequestOutput per prompt, in prompt order.

        All prompts are validated before any is queued, so a bad one raises ValueError and
        leaves the engine untouched.
        """
        if self._closed:
            raise ValueError("this LLM was shut down")
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        base = self.engine.next_request_id()
        seqs = [self.engine.make_sequence(p, sp, f"{base}-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        for seq in seqs:
            self.engine.add_sequence(seq)
        order = {s.request_id: i for i, s in enumerate(seqs)}
        results: list[RequestOutput | None] = [None] * len(seqs)
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for o in self.engine.step():
                    if o.finished and o.request_id in order:
                        results[order[o.request_id]] = o
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for seq in seqs:  # leave no half-run request holding blocks
                if not seq.is_finished:
                    self.engine.abort_request(seq.request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]

    def chat(
        self, messages: list[dict[str, str]] | list[list[dict[str, str]]], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generates from one conversation or a list of them, via the chat template."""
        if messages and isinstance(messages[0], dict):  # one conversation
            convs = [messages]
        else:  # a list of conversations (mypy cannot narrow this branch)
            convs = cast("list[list[dict[str, str]]]", messages)
        return self.generate([self.apply_chat_template(c) for c in convs], sampling_params)

    # ---- stats and lifecycle ----
    def get_stats(self) -> dict[str, Any]:
        """Returns prefix-cache queries/hits (tokens), block usage and scheduler counters."""
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Drops the engine's prefix cache; returns False while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Flushes and shuts down the connector (if any); later `generate` calls fail."""
        if self._closed:
            return
        self._closed = True
        if self.engine.kv_connector is not None:
            self.engine.kv_connector.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
