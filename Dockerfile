# specshadow gateway image: the wheel built in a throwaway stage, run as a non-root user.
# `pip install` of the wheel without extras is the gateway alone: no numpy, matplotlib or openai
# SDK (reports and load generation are `specshadow[report]` / `[loadgen]`, not for this image).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md MANIFEST.in _build_clean.py ./
COPY core ./core
COPY policies ./policies
COPY otel ./otel
COPY simulator ./simulator
COPY evidence ./evidence
COPY records ./records
COPY rollout ./rollout
COPY gateway ./gateway
COPY loadgen ./loadgen
COPY report ./report
COPY backends ./backends
COPY counterfactual ./counterfactual
COPY specshadow ./specshadow
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin specshadow
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY policies/examples /etc/specshadow/examples
USER 10001
EXPOSE 8080
ENV PYTHONUNBUFFERED=1
# The policy is mounted (e.g. a ConfigMap directory) and hot-reloaded; see deploy/.
ENTRYPOINT ["specshadow", "serve"]
CMD ["--host", "0.0.0.0", "--port", "8080", "--policy", "/etc/specshadow/policy.yaml"]
