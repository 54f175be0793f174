"""The balancer's HTTP fronts: OpenAI's API, SGLang's native API and SMG's worker and RL control planes.

Every front turns HTTP requests into the balancer's own ``GenerateRequest`` and its token stream back into
the caller's format. They share the request checks and errors (:mod:`.openai_requests`), one choice runner
(:mod:`.openai_choices`) and one incremental decoder (:mod:`.detokenize`), so a streamed completion costs
time linear in its length whichever front serves it.
"""
