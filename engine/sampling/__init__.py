"""What to generate and how to pick each token: the request's ``params``
(:class:`SamplingParams`), repetition ``penalties``, and the batched ``sampler``."""
