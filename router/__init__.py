"""kvrouter's HTTP gateway: OpenAI surface, tokenization, policies, proxying."""

from router import metric_values

# Before any module of the package creates a metric: a worker of ``serve --workers N``
# writes its series to the multiprocess files in batches (see router.metric_values).
metric_values.install()
