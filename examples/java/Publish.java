// Publishes to delay-bridge with the RabbitMQ Java client, then watches what arrives.
//
// Usage (Java 11 or later runs the source file as it is; the client is
// com.rabbitmq:amqp-client, 5.x, which needs slf4j-api):
//   java -cp amqp-client.jar:slf4j-api.jar Publish.java [AMQP_URL [INGRESS [CANCEL_EXCHANGE [TARGET]]]]
// The defaults fit config/delay-bridge.toml: amqp://guest:guest@127.0.0.1:5672/%2f,
// delayed, delay-bridge.cancel (<prefix>.cancel), amq.direct.
//
// Four messages, nothing but AMQP: one with x-delay, one with x-deliver-at, one recurring
// (every 2 s, 3 times) and one scheduled, then cancelled by publishing a tombstone. Exits 0
// when each arrived on time (not early, at most 1 s late) and the cancelled one never did.

import com.rabbitmq.client.AMQP;
import com.rabbitmq.client.Channel;
import com.rabbitmq.client.Connection;
import com.rabbitmq.client.ConnectionFactory;
import java.nio.charset.StandardCharsets;
import java.time.Instant;
import java.time.ZoneOffset;
import java.time.format.DateTimeFormatter;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

public class Publish {
    static final long TOLERANCE_MS = 1000;
    static final DateTimeFormatter CLOCK =
        DateTimeFormatter.ofPattern("HH:mm:ss.SSS").withZone(ZoneOffset.UTC);

    static final Map<String, String> labels = new ConcurrentHashMap<>();
    static final Map<String, Long> dueAt = new ConcurrentHashMap<>();

    static String arg(String[] args, int i, String fallback) {
        return args.length > i ? args[i] : fallback;
    }

    static String clock(long ms) {
        return CLOCK.format(Instant.ofEpochMilli(ms));
    }

    public static void main(String[] args) throws Exception {
        String url = arg(args, 0, "amqp://guest:guest@127.0.0.1:5672/%2f");
        String ingress = arg(args, 1, "delayed");
        String cancelExchange = arg(args, 2, "delay-bridge.cancel");
        String target = arg(args, 3, "amq.direct");

        String run = "java-" + System.currentTimeMillis(); // routing key, start of the ids
        ConnectionFactory factory = new ConnectionFactory();
        factory.setUri(url);
        Connection connection = factory.newConnection();
        Channel channel = connection.createChannel();
        channel.confirmSelect();

        // A queue of our own on the target exchange: due messages are delivered there with
        // the routing key they were published with.
        String queue = channel.queueDeclare().getQueue(); // server-named, exclusive
        channel.queueBind(queue, target, run);

        long start = System.currentTimeMillis();
        // 1. A delay in milliseconds, counted from when the bridge reads the message.
        publish(channel, ingress, run, run + "-delay", "x-delay 3000 ms",
            Map.of("x-delay", 3000), start + 3000);
        // 2. An absolute time in epoch milliseconds (a long; an RFC 3339 string works too).
        long at = System.currentTimeMillis() + 4000;
        publish(channel, ingress, run, run + "-at", "x-deliver-at +4 s",
            Map.of("x-deliver-at", at), at);
        // 3. A recurring schedule: every 2 s, 3 occurrences; it needs a message_id. Each
        //    occurrence arrives with x-occurrence (1, 2, 3) and x-occurrence-due (epoch ms).
        publish(channel, ingress, run, run + "-every", "every 2 s",
            Map.of("x-repeat-every", "2s", "x-repeat-count", 3), null);
        // 4. A message due in 5 s, cancelled at once. x-published-at (epoch ms) says when the
        //    copy entered, so the cancel covers it even before a bridge has read it.
        String cancelled = run + "-cancelled";
        long published = System.currentTimeMillis();
        publish(channel, ingress, run, cancelled, "x-delay 5000 ms",
            Map.of("x-delay", 5000, "x-published-at", published), published + 5000);

        // The cancel: a tombstone published to the fanout exchange <prefix>.cancel, with an
        // empty body and message_id = the id to cancel. It drops every copy of the id that
        // entered at or before delay-bridge-cancelled-at; delay-bridge-due-at (optional)
        // lets bridges forget it after that time. Both are epoch ms as a long (64-bit).
        Map<String, Object> tombstone = Map.of(
            "delay-bridge-kind", "cancel",
            "delay-bridge-cancelled-at", System.currentTimeMillis(),
            "delay-bridge-due-at", published + 5000);
        channel.basicPublish(cancelExchange, "", new AMQP.BasicProperties.Builder()
            .messageId(cancelled).deliveryMode(2).headers(tombstone).build(), new byte[0]);
        channel.waitForConfirmsOrDie(5000);
        System.out.printf("cancelled  %-20s %s (tombstone confirmed)%n", "x-delay 5000 ms", cancelled);

        // Watch the queue until everything is due, and a little longer.
        System.out.printf("arrivals:%n  %-20s %-12s  %-12s  late%n", "message", "due", "arrived");
        Set<String> seen = ConcurrentHashMap.newKeySet();
        List<String> failures = new ArrayList<>();
        channel.basicConsume(queue, true, (tag, delivery) -> {
            long arrived = System.currentTimeMillis();
            String id = delivery.getProperties().getMessageId();
            Map<String, Object> headers = delivery.getProperties().getHeaders();
            String label = labels.get(id);
            long due = dueAt.getOrDefault(id, 0L);
            if (headers != null && headers.containsKey("x-occurrence")) {
                label = label + " #" + headers.get("x-occurrence");
                due = ((Number) headers.get("x-occurrence-due")).longValue();
            }
            long late = arrived - due;
            System.out.printf("  %-20s %s  %s  %+d ms%n", label, clock(due), clock(arrived), late);
            seen.add(label);
            synchronized (failures) {
                if (id.equals(cancelled)) {
                    failures.add("the cancelled message arrived");
                } else if (late < 0 || late > TOLERANCE_MS) {
                    failures.add(label + " arrived " + late + " ms from its due time");
                }
            }
        }, tag -> {});
        Thread.sleep(Math.max(0, start + 6000 + TOLERANCE_MS + 500 - System.currentTimeMillis()));
        connection.close();

        for (String label : List.of("x-delay 3000 ms", "x-deliver-at +4 s",
                "every 2 s #1", "every 2 s #2", "every 2 s #3")) {
            if (!seen.contains(label)) {
                failures.add(label + " never arrived");
            }
        }
        if (!failures.isEmpty()) {
            System.out.println("FAILED: " + String.join("; ", failures));
            System.exit(1);
        }
        System.out.println("ok: 5 arrived on time, the cancelled one never");
    }

    static void publish(Channel channel, String ingress, String run, String messageId,
            String label, Map<String, Object> headers, Long due) throws Exception {
        AMQP.BasicProperties properties = new AMQP.BasicProperties.Builder()
            .messageId(messageId).deliveryMode(2).headers(headers).build();
        channel.basicPublish(ingress, run, properties, label.getBytes(StandardCharsets.UTF_8));
        channel.waitForConfirmsOrDie(5000);
        labels.put(messageId, label);
        if (due != null) {
            dueAt.put(messageId, due);
        }
        System.out.printf("published  %-20s %s%n", label, messageId);
    }
}
