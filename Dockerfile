# kvepp endpoint picker: static binary on a distroless base, running as a non-root user.
# Build: docker build -t kvepp/epp .
# Run (from the repository root, beside ../shared as the README says):
#        docker run -v "$PWD/../shared/models/qwen3:/tokenizer:ro" -v "$PWD/examples:/cfg:ro" \
#          -e DYN_EPP_TOKENIZER_DIR=/tokenizer -e DYN_EPP_WORKERS_FILE=/cfg/workers.yaml \
#          -p 9002:9002 -p 9003:9003 -p 8092:8092 -p 9090:9090 kvepp/epp
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# -tags vtprotobuf: ext_proc replies are encoded by go-control-plane's generated code (extproc/codec.go).
RUN CGO_ENABLED=0 GOOS=linux go build -tags vtprotobuf -trimpath -ldflags="-s -w" -o /out/epp ./cmd/epp

FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/epp /usr/local/bin/epp
USER 65532:65532
# 9002 ext_proc gRPC, 9003 gRPC health, 8092 selection HTTP API, 9090 Prometheus metrics,
# 9092 replica sync (ZeroMQ PUB)
EXPOSE 9002 9003 8092 9090 9092
ENTRYPOINT ["/usr/local/bin/epp"]
