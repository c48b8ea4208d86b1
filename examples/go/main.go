// Publishes to delay-bridge with amqp091-go, then watches what arrives.
//
// Usage: go run . [AMQP_URL [INGRESS [CANCEL_EXCHANGE [TARGET]]]]
// The defaults fit config/delay-bridge.toml: amqp://guest:guest@127.0.0.1:5672/%2f,
// delayed, delay-bridge.cancel (<prefix>.cancel), amq.direct.
//
// Four messages, nothing but AMQP: one with x-delay, one with x-deliver-at, one recurring
// (every 2 s, 3 times) and one scheduled, then cancelled by publishing a tombstone. Exits 0
// when each arrived on time (not early, at most 1 s late) and the cancelled one never did.
//
// Epoch milliseconds go into headers as int64: amqp091-go writes a plain int as a 32-bit
// integer, which cannot hold them.
package main

import (
	"fmt"
	"log"
	"os"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

const toleranceMs = 1000

func nowMs() int64 { return time.Now().UnixMilli() }

func clock(ms int64) string { return time.UnixMilli(ms).UTC().Format("15:04:05.000") }

func arg(i int, fallback string) string {
	if len(os.Args) > i {
		return os.Args[i]
	}
	return fallback
}

func main() {
	url := arg(1, "amqp://guest:guest@127.0.0.1:5672/%2f")
	ingress := arg(2, "delayed")
	cancelExchange := arg(3, "delay-bridge.cancel")
	target := arg(4, "amq.direct")

	run := fmt.Sprintf("go-%d", nowMs()) // this run's routing key, and the start of its ids
	connection, err := amqp.Dial(url)
	check(err)
	channel, err := connection.Channel()
	check(err)
	check(channel.Confirm(false))
	// One confirmation per publish, in order. (DeferredConfirmation.Wait can hang in
	// amqp091-go before 1.8, rabbitmq/amqp091-go#182: seen here with Debian's 1.5.)
	confirms := channel.NotifyPublish(make(chan amqp.Confirmation, 1))

	// A queue of our own on the target exchange: due messages are delivered there with the
	// routing key they were published with.
	queue, err := channel.QueueDeclare("", false, true, true, false, nil)
	check(err)
	check(channel.QueueBind(queue.Name, run, target, false, nil))
	deliveries, err := channel.Consume(queue.Name, "", true, true, false, false, nil)
	check(err)

	labels := map[string]string{} // message_id -> what it is
	dueAt := map[string]int64{}   // message_id -> when it is due, epoch ms
	publish := func(exchange, messageID string, headers amqp.Table, body string) {
		check(channel.Publish(exchange, run, false, false, amqp.Publishing{
			MessageId: messageID, DeliveryMode: amqp.Persistent, Headers: headers, Body: []byte(body),
		}))
		if confirmed := <-confirms; !confirmed.Ack {
			log.Fatalf("the broker refused %s", messageID)
		}
	}
	schedule := func(messageID, label string, headers amqp.Table, due int64) {
		publish(ingress, messageID, headers, label)
		labels[messageID], dueAt[messageID] = label, due
		fmt.Printf("published  %-20s %s\n", label, messageID)
	}

	start := nowMs()
	// 1. A delay in milliseconds, counted from when the bridge reads the message.
	schedule(run+"-delay", "x-delay 3000 ms", amqp.Table{"x-delay": int64(3000)}, start+3000)
	// 2. An absolute time in epoch milliseconds (an RFC 3339 string works too).
	at := nowMs() + 4000
	schedule(run+"-at", "x-deliver-at +4 s", amqp.Table{"x-deliver-at": at}, at)
	// 3. A recurring schedule: every 2 s, 3 occurrences; it needs a message_id. Each
	//    occurrence arrives with x-occurrence (1, 2, 3) and x-occurrence-due (epoch ms).
	schedule(run+"-every", "every 2 s",
		amqp.Table{"x-repeat-every": "2s", "x-repeat-count": int64(3)}, 0)
	// 4. A message due in 5 s, cancelled at once. x-published-at (epoch ms) says when the
	//    copy entered, so the cancel covers it even before a bridge has read it.
	cancelled := run + "-cancelled"
	published := nowMs()
	schedule(cancelled, "x-delay 5000 ms",
		amqp.Table{"x-delay": int64(5000), "x-published-at": published}, published+5000)

	// The cancel: a tombstone published to the fanout exchange <prefix>.cancel, with an
	// empty body and message_id = the id to cancel. It drops every copy of the id that
	// entered at or before delay-bridge-cancelled-at; delay-bridge-due-at (optional) lets
	// bridges forget it after that time. Both are epoch ms, int64.
	publish(cancelExchange, cancelled, amqp.Table{
		"delay-bridge-kind":         "cancel",
		"delay-bridge-cancelled-at": nowMs(),
		"delay-bridge-due-at":       published + 5000,
	}, "")
	fmt.Printf("cancelled  %-20s %s (tombstone confirmed)\n", "x-delay 5000 ms", cancelled)

	// Watch the queue until everything is due, and a little longer.
	fmt.Printf("arrivals:\n  %-20s %-12s  %-12s  late\n", "message", "due", "arrived")
	seen := map[string]bool{}
	var failures []string
	deadline := time.After(time.Until(time.UnixMilli(start + 6000 + toleranceMs + 500)))
watch:
	for {
		select {
		case <-deadline:
			break watch
		case delivery, open := <-deliveries:
			if !open {
				failures = append(failures, "the connection closed")
				break watch
			}
			arrived := nowMs()
			label, due := labels[delivery.MessageId], dueAt[delivery.MessageId]
			if n, ok := delivery.Headers["x-occurrence"]; ok {
				label = fmt.Sprintf("%s #%v", label, n)
				due = delivery.Headers["x-occurrence-due"].(int64)
			}
			late := arrived - due
			fmt.Printf("  %-20s %s  %s  %+d ms\n", label, clock(due), clock(arrived), late)
			seen[label] = true
			if delivery.MessageId == cancelled {
				failures = append(failures, "the cancelled message arrived")
			} else if late < 0 || late > toleranceMs {
				failures = append(failures, fmt.Sprintf("%s arrived %+d ms from its due time", label, late))
			}
		}
	}
	connection.Close()

	wanted := []string{"x-delay 3000 ms", "x-deliver-at +4 s", "every 2 s #1", "every 2 s #2", "every 2 s #3"}
	for _, label := range wanted {
		if !seen[label] {
			failures = append(failures, label+" never arrived")
		}
	}
	if len(failures) > 0 {
		fmt.Println("FAILED: " + strings.Join(failures, "; "))
		os.Exit(1)
	}
	fmt.Println("ok: 5 arrived on time, the cancelled one never")
}

func check(err error) {
	if err != nil {
		log.Fatal(err)
	}
}
