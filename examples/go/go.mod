// The example's module. Outside Debian, `go mod tidy` fetches the client and writes
// go.sum; scripts/examples.sh builds against Debian's golang-github-rabbitmq-amqp091-go-dev
// instead (GOPATH=/usr/share/gocode, offline).
module delay-bridge-example

go 1.19

require github.com/rabbitmq/amqp091-go v1.5.0
