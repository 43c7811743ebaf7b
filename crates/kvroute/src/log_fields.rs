//! How text logs write a span's or an event's fields: as `tracing-subscriber`'s
//! [`DefaultFields`] writes them, byte for byte, with less work where no colour is asked for.
//!
//! The proxy opens a span per request (its id, method and path), and the text formatter writes
//! the span's fields into a string when the span opens, whether or not a line is ever logged in
//! it. [`DefaultFields`] writes each field as `{italic name}{dimmed "="}{value:?}` through
//! `nu_ansi_term`'s styled strings even when the styles are empty (no terminal): about 3,400
//! instructions for the request span's three fields, 2,200 of them in the empty styles
//! (BENCHMARKS.md, "Proxy: CPU per request in instructions"). [`PlainFields`] writes `name=value:?`
//! directly when the writer takes no ANSI escapes (gathered on the stack and handed over in one
//! piece, so that a span's string grows once rather than with every name, `=` and value), and
//! hands everything else to
//! [`DefaultVisitor`] (colours, `message`, raw `r#` names, errors with their sources), so the
//! text is the same.
//!
//! [`DefaultFields`]: tracing_subscriber::fmt::format::DefaultFields

use std::fmt::{self, Write as _};

use tracing::field::{Field, Visit};
use tracing_subscriber::field::{MakeVisitor, VisitFmt, VisitOutput};
use tracing_subscriber::fmt::format::{DefaultVisitor, Writer};

/// [`DefaultFields`](tracing_subscriber::fmt::format::DefaultFields)' text, written directly
/// when there is no colour.
#[derive(Clone, Copy, Debug, Default)]
pub struct PlainFields;

impl<'a> MakeVisitor<Writer<'a>> for PlainFields {
    type Visitor = PlainVisitor<'a>;

    fn make_visitor(&self, target: Writer<'a>) -> Self::Visitor {
        PlainVisitor {
            writer: target,
            is_empty: true,
            result: Ok(()),
            held: Held::default(),
        }
    }
}

/// Plain fields' text not yet handed to the writer.
#[derive(Debug)]
struct Held {
    bytes: [u8; HELD],
    len: usize,
}

/// How much text [`Held`] gathers before it is handed over.
const HELD: usize = 256;

impl Default for Held {
    fn default() -> Self {
        Self {
            bytes: [0; HELD],
            len: 0,
        }
    }
}

impl fmt::Write for Held {
    /// Takes `s` whole, or refuses it if it does not fit.
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let end = self.len + s.len();
        let to = self.bytes.get_mut(self.len..end).ok_or(fmt::Error)?;
        to.copy_from_slice(s.as_bytes());
        self.len = end;
        Ok(())
    }
}

/// [`PlainFields`]' visitor: [`DefaultVisitor`]'s output.
#[derive(Debug)]
pub struct PlainVisitor<'a> {
    writer: Writer<'a>,
    is_empty: bool,
    result: fmt::Result,
    held: Held,
}

impl PlainVisitor<'_> {
    /// Whether [`DefaultVisitor`] writes field `name` in the plain `name=value:?` form: not
    /// with colours, not the message (escaped, unnamed), not a raw identifier (`r#` dropped).
    fn plain(&self, name: &str) -> bool {
        !self.writer.has_ansi_escapes() && name != "message" && !name.starts_with("r#")
    }

    /// Lets [`DefaultVisitor`] write one field, after the fields written so far.
    fn delegate(&mut self, record: impl FnOnce(&mut DefaultVisitor<'_>)) {
        self.flush();
        if self.result.is_err() {
            return;
        }
        let mut visitor = DefaultVisitor::new(self.writer.by_ref(), self.is_empty);
        record(&mut visitor);
        self.result = visitor.finish();
        self.is_empty = false;
    }

    /// Hands the held text to the writer.
    fn flush(&mut self) {
        let len = std::mem::take(&mut self.held.len);
        if len > 0 && self.result.is_ok() {
            // Held text is whole `str`s, so valid UTF-8.
            self.result = std::str::from_utf8(&self.held.bytes[..len])
                .map_err(|_| fmt::Error)
                .and_then(|text| self.writer.write_str(text));
        }
    }
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if self.result.is_err() {
            return;
        }
        if self.plain(field.name()) {
            self.record_debug(field, &value);
        } else {
            self.delegate(|v| v.record_str(field, value));
        }
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        if self.result.is_err() {
            return;
        }
        self.delegate(|v| v.record_error(field, value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        if self.result.is_err() {
            return;
        }
        let name = field.name();
        if !self.plain(name) {
            self.delegate(|v| v.record_debug(field, value));
            return;
        }
        let pad = if std::mem::take(&mut self.is_empty) {
            ""
        } else {
            " "
        };
        let at = self.held.len;
        if write!(self.held, "{pad}{name}={value:?}").is_err() {
            // Too long to hold: what is held goes first, then this field, directly.
            self.held.len = at;
            self.flush();
            if self.result.is_ok() {
                self.result = write!(self.writer, "{pad}{name}={value:?}");
            }
        }
    }
}

impl VisitOutput<fmt::Result> for PlainVisitor<'_> {
    fn finish(mut self) -> fmt::Result {
        self.flush();
        self.result
    }
}

impl VisitFmt for PlainVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        self.flush();
        &mut self.writer
    }
}

#[cfg(test)]
mod tests {
    use std::io;
    use std::sync::{Arc, Mutex};

    use proptest::prelude::*;
    use tracing_subscriber::fmt::MakeWriter;
    use tracing_subscriber::fmt::format::{DefaultFields, FmtSpan};

    use super::*;

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Captured {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Self;
        fn make_writer(&'a self) -> Self {
            self.clone()
        }
    }

    #[derive(Debug)]
    struct Outer(io::Error);
    impl fmt::Display for Outer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "outer failed")
        }
    }
    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    /// Logs the same lines (spans with fields, recorded later too; events with messages, raw
    /// names, strings, numbers, errors) through a text subscriber with `fields`, and returns
    /// the text, times cut out.
    fn log_lines<N>(fields: N, ansi: bool, text: &str, number: i64) -> String
    where
        N: for<'w> tracing_subscriber::fmt::FormatFields<'w> + Send + Sync + 'static,
    {
        let out = Captured::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(out.clone())
            .with_ansi(ansi)
            .without_time()
            .with_span_events(FmtSpan::CLOSE)
            .fmt_fields(fields)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let id = format!("kvr-1a2b-{number}");
            let span = tracing::info_span!("request", request_id = %id, method = %"POST", path = %text);
            let _entered = span.enter();
            tracing::info!("a message with {text} and {number}");
            tracing::warn!(text, number, flag = true, ratio = 0.5, "fields and a message");
            tracing::info!(r#type = "raw", debugged = ?text, shown = %text);
            tracing::info!(message = text, after = number);
            let inner = tracing::info_span!("inner", empty = tracing::field::Empty, n = number);
            let _inner = inner.enter();
            inner.record("empty", text);
            let error = Outer(io::Error::other(text.to_owned()));
            tracing::error!(error = &error as &(dyn std::error::Error + 'static), "failed");
            tracing::error!(
                plain = &io::Error::other("plain") as &(dyn std::error::Error + 'static),
                "log.target" = "x"
            );
            tracing::info!(text);
        });
        let bytes = out.0.lock().unwrap().clone();
        String::from_utf8(bytes).unwrap()
    }

    #[test]
    fn text_logs_read_as_the_default_fields_write_them() {
        // The last is longer than the text held before it is handed over.
        let long = "é-".repeat(HELD);
        for ansi in [false, true] {
            for text in [
                "/v1/chat/completions",
                "",
                "quote \" and \u{1b}[31m escape",
                "é\n",
                &long,
            ] {
                let default = log_lines(DefaultFields::new(), ansi, text, -3);
                assert_eq!(
                    log_lines(PlainFields, ansi, text, -3),
                    default,
                    "ansi {ansi}, {text:?}"
                );
                // Both forms are exercised: plain text, and colours (handed over whole).
                assert_eq!(default.contains("request_id=kvr-1a2b--3"), !ansi);
                assert_eq!(default.contains('\u{1b}'), ansi || text.contains('\u{1b}'));
            }
        }
    }

    proptest! {
        #[test]
        fn any_text_logs_as_the_default_fields_log_it(text in ".{0,300}", number: i64, ansi: bool) {
            prop_assert_eq!(
                log_lines(PlainFields, ansi, &text, number),
                log_lines(DefaultFields::new(), ansi, &text, number)
            );
        }
    }
}
