package dev.pushworker.guard;

import io.prometheus.client.Counter;
import java.util.List;
import java.util.Map;
import org.apache.bookkeeper.mledger.Entry;
import org.apache.pulsar.broker.service.Consumer;
import org.apache.pulsar.broker.service.Subscription;
import org.apache.pulsar.broker.service.plugin.EntryFilter;
import org.apache.pulsar.broker.service.plugin.FilterContext;
import org.apache.pulsar.common.api.proto.MessageMetadata;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * Keeps messages that declare more bytes than a push worker can take away from push consumers.
 *
 * <p>A compressed message declares its inflated size ({@code uncompressed_size}) and a chunked one its
 * whole size ({@code total_chunk_msg_size}); the Pulsar client allocates that much, and inflates or
 * gathers into it, before the worker sees the message: a few KiB of zstd that declare 1.5 GiB kill the
 * worker's pod. This filter reads those declarations from the entry's metadata, which the broker has
 * parsed already, and rejects the entry for a push consumer (the broker acknowledges it for that
 * subscription: it is never dispatched there), counting and logging each one with its id.
 *
 * <p>Why an entry filter: Pulsar's plugin API has no hook that both sees a published message's
 * metadata and can refuse it with an error the producer gets. {@code BrokerInterceptor.onPulsarCommand}
 * can answer a send with an error but sees only the command (no metadata); {@code onMessagePublish}
 * sees the payload but cannot refuse (it returns nothing, and an exception there drops the producer's
 * connection, which resends the message). An entry filter runs before every dispatch, for every
 * subscription type, and its verdict is final for that subscription.
 *
 * <p>Settings (environment variables of the broker's process, or the same names as Java system
 * properties): {@code PUSH_WORKER_GUARD_MAX_BYTES} the largest declared size let through (default
 * 64 MiB); {@code PUSH_WORKER_GUARD_SCOPE} {@code push} (default: only consumers that declare the
 * consumer property {@code push-worker}, as push-worker's do) or {@code all} (every consumer).
 */
public final class OversizeGuard implements EntryFilter {
    static final String MAX_BYTES = "PUSH_WORKER_GUARD_MAX_BYTES";
    static final String SCOPE = "PUSH_WORKER_GUARD_SCOPE";
    /** The consumer property (consumer metadata) push-worker's consumers declare. */
    static final String PUSH_CONSUMER_PROPERTY = "push-worker";
    static final long DEFAULT_MAX_BYTES = 64L << 20;

    private static final Logger LOG = LoggerFactory.getLogger(OversizeGuard.class);

    private final long maxBytes;
    private final boolean everyConsumer;

    /** As the broker makes it: settings from the environment or system properties. */
    public OversizeGuard() {
        this(setting(MAX_BYTES), setting(SCOPE));
    }

    OversizeGuard(String maxBytes, String scope) {
        this.maxBytes = maxBytes == null || maxBytes.isBlank() ? DEFAULT_MAX_BYTES : Long.parseLong(maxBytes.trim());
        if (this.maxBytes < 0) {
            throw new IllegalArgumentException(MAX_BYTES + " must not be negative: " + maxBytes);
        }
        String chosen = scope == null || scope.isBlank() ? "push" : scope.trim();
        if (!chosen.equals("push") && !chosen.equals("all")) {
            throw new IllegalArgumentException(SCOPE + " must be push or all, not " + scope);
        }
        this.everyConsumer = chosen.equals("all");
        LOG.info("push-worker guard: messages declaring more than {} bytes are kept from {} consumers", this.maxBytes,
                everyConsumer ? "all" : "push-worker's");
    }

    private static String setting(String name) {
        String value = System.getProperty(name);
        return value != null ? value : System.getenv(name);
    }

    @Override
    public FilterResult filterEntry(Entry entry, FilterContext context) {
        MessageMetadata metadata = context.getMsgMetadata();
        if (metadata == null) {
            return FilterResult.ACCEPT;
        }
        String why = oversize(metadata, entry.getLength());
        if (why == null || !applies(context)) {
            return FilterResult.ACCEPT;
        }
        Subscription subscription = context.getSubscription();
        String topic = subscription != null ? subscription.getTopicName() : "?";
        String name = subscription != null ? subscription.getName() : "?";
        Metrics.KEPT_AWAY.labels(metadata.hasTotalChunkMsgSize() ? "chunked" : "compressed").inc();
        LOG.warn("push-worker guard: message {}:{} of {} kept away from subscription {}: it {} (limit {} bytes)",
                entry.getLedgerId(), entry.getEntryId(), topic, name, why, maxBytes);
        return FilterResult.REJECT;
    }

    /** Why the entry is over the limit, or null. Sizes are unsigned on the wire: a negative one is huge. */
    String oversize(MessageMetadata metadata, int entryLength) {
        if (metadata.hasTotalChunkMsgSize()) {
            long total = Integer.toUnsignedLong(metadata.getTotalChunkMsgSize());
            if (total > maxBytes) {
                return "is chunked to " + total + " bytes";
            }
        }
        if (metadata.hasUncompressedSize()) {
            long inflated = Integer.toUnsignedLong(metadata.getUncompressedSize());
            if (inflated > maxBytes) {
                return "inflates to " + inflated + " bytes (" + metadata.getCompression() + ")";
            }
        }
        return entryLength > maxBytes ? "is " + entryLength + " bytes" : null;
    }

    private boolean applies(FilterContext context) {
        if (everyConsumer) {
            return true;
        }
        Consumer consumer = context.getConsumer();
        if (consumer != null) {
            return isPush(consumer);
        }
        Subscription subscription = context.getSubscription();
        List<Consumer> consumers = subscription != null ? subscription.getConsumers() : List.of();
        return consumers.stream().anyMatch(OversizeGuard::isPush);
    }

    private static boolean isPush(Consumer consumer) {
        Map<String, String> metadata = consumer.getMetadata();
        return metadata != null && metadata.containsKey(PUSH_CONSUMER_PROPERTY);
    }

    @Override
    public void close() {
    }

    /** One counter per broker process, whichever of the filter's instances counts (the broker may make several). */
    static final class Metrics {
        static final Counter KEPT_AWAY = Counter.build()
                .name("pushworker_guard_kept_away_total")
                .help("Messages push-worker's guard kept away from push consumers, by what they declared")
                .labelNames("kind")
                .register();

        private Metrics() {
        }
    }
}
