//! Publishing task events to containerd.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use containerd_shim::event::Event;
use containerd_shim::protos::protobuf::MessageDyn;
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::Context;

/// Where task events go: containerd's event service in the real shim, a
/// list in the unit tests.
#[async_trait]
pub trait EventSink: Send + Sync + 'static {
    async fn publish(&self, topic: String, event: Box<dyn MessageDyn>);
}

/// Publishes through containerd's `TTRPC_ADDRESS` (the crate's queue, which
/// retries).
pub struct RemoteEvents {
    publisher: RemotePublisher,
    namespace: String,
}

impl RemoteEvents {
    pub fn new(publisher: RemotePublisher, namespace: String) -> Self {
        Self {
            publisher,
            namespace,
        }
    }
}

#[async_trait]
impl EventSink for RemoteEvents {
    async fn publish(&self, topic: String, event: Box<dyn MessageDyn>) {
        if let Err(e) = self
            .publisher
            .publish(Context::default(), &topic, &self.namespace, event)
            .await
        {
            tracing::warn!("publishing {topic} failed: {e}");
        }
    }
}

/// Events recorded by [`RecordedEvents`]: topic and message.
pub type EventLog = Arc<Mutex<Vec<(String, Box<dyn MessageDyn>)>>>;

/// Collects events (tests, and a shim that has no containerd to talk to).
#[derive(Default, Clone)]
pub struct RecordedEvents {
    pub events: EventLog,
}

impl RecordedEvents {
    /// Topics published so far, in order.
    pub fn topics(&self) -> Vec<String> {
        self.events
            .lock()
            .map(|v| v.iter().map(|(t, _)| t.clone()).collect())
            .unwrap_or_default()
    }
}

#[async_trait]
impl EventSink for RecordedEvents {
    async fn publish(&self, topic: String, event: Box<dyn MessageDyn>) {
        if let Ok(mut v) = self.events.lock() {
            v.push((topic, event));
        }
    }
}

/// Publish an event whose type knows its topic.
pub async fn send<E: Event + MessageDyn + 'static>(sink: &dyn EventSink, event: E) {
    let topic = event.topic();
    sink.publish(topic, Box::new(event)).await;
}
