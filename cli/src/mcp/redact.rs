//! Known secret shapes taken out of everything `burrow mcp` returns to a
//! model: cloud keys, tokens, private key blocks, bearer credentials and
//! the values of secret-named `KEY=value` lines (every value, in a `.env`
//! file). Each is replaced by a `[REDACTED:kind]` marker, so the model
//! knows something was there; the text is never interpreted otherwise.

use std::sync::OnceLock;

use regex::{Captures, Regex};

/// The marker a secret of `kind` becomes.
pub fn marker(kind: &str) -> String {
    format!("[REDACTED:{kind}]")
}

/// Secret shapes matched anywhere: (kind, pattern).
const TOKENS: &[(&str, &str)] = &[
    (
        "private-key",
        r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----(?s:.*?)(-----END [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----|\z)",
    ),
    (
        "aws-access-key",
        r"\b(AKIA|ASIA|AGPA|AIDA|AROA)[0-9A-Z]{16}\b",
    ),
    (
        "github-token",
        r"\b(ghp|gho|ghu|ghs|ghr)_[A-Za-z0-9]{30,255}\b",
    ),
    ("github-token", r"\bgithub_pat_[A-Za-z0-9_]{22,255}\b"),
    ("gitlab-token", r"\bglpat-[A-Za-z0-9_-]{20,255}\b"),
    ("slack-token", r"\bxox[abposr]-[A-Za-z0-9-]{10,255}"),
    ("api-key", r"\bsk-(proj-|ant-)?[A-Za-z0-9_-]{20,255}"),
    ("google-api-key", r"\bAIza[0-9A-Za-z_-]{35}\b"),
    (
        "jwt",
        r"\beyJ[A-Za-z0-9_-]{8,4096}\.eyJ[A-Za-z0-9_-]{8,8192}\.[A-Za-z0-9_-]{8,4096}",
    ),
];

/// `Bearer xyz` / `Basic xyz` credentials: the scheme is kept.
const BEARER: &str = r"(?i)\b(bearer|basic|token)(\s+)[A-Za-z0-9._~+/=-]{8,4096}";

/// `KEY=value` / `KEY: value` where KEY names a secret; the name is kept.
const SECRET_ASSIGNMENT: &str = r#"(?im)\b([A-Z0-9_.-]*(?:KEY|SECRET|TOKEN|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?|PRIVATE|AUTH|API_?KEY|DSN)[A-Z0-9_.-]*)(["']?\s*[=:]\s*)([^\s"'\[][^\s"']*|"[^"\n]*"|'[^'\n]*')"#;

/// Every `KEY=value` line (a `.env` file): the name is kept.
const ENV_LINE: &str = r"(?m)^(\s*(?:export\s+)?[A-Za-z_][A-Za-z0-9_.]*\s*=\s*)(\S.*)$";

struct Patterns {
    tokens: Vec<(&'static str, Regex)>,
    bearer: Regex,
    assignment: Regex,
    env_line: Regex,
}

#[allow(clippy::expect_used)] // the patterns are constants, checked by the tests
fn patterns() -> &'static Patterns {
    static P: OnceLock<Patterns> = OnceLock::new();
    P.get_or_init(|| {
        let re = |p: &str| Regex::new(p).expect("a valid secret pattern");
        Patterns {
            tokens: TOKENS.iter().map(|(k, p)| (*k, re(p))).collect(),
            bearer: re(BEARER),
            assignment: re(SECRET_ASSIGNMENT),
            env_line: re(ENV_LINE),
        }
    })
}

/// Text with its secrets replaced, and what kinds were found (one entry per
/// secret).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Redacted {
    pub text: String,
    pub found: Vec<&'static str>,
}

impl Redacted {
    /// A note for the model, or None when nothing was redacted.
    pub fn note(&self) -> Option<String> {
        if self.found.is_empty() {
            return None;
        }
        let mut kinds = self.found.clone();
        kinds.sort_unstable();
        kinds.dedup();
        Some(format!(
            "[{} secret(s) redacted: {}]",
            self.found.len(),
            kinds.join(", ")
        ))
    }
}

/// `text` with known secret shapes replaced; with `env_file`, the value of
/// every `KEY=value` line too (the text is a `.env` file).
pub fn redact(text: &str, env_file: bool) -> Redacted {
    let p = patterns();
    let mut found = Vec::new();
    let mut text = text.to_string();
    // Replace what `re` matches by `kind`'s marker, keeping groups `keep`
    // (a name, a scheme) before it.
    let mut apply = |text: &mut String, re: &Regex, kind: &'static str, keep: &[usize]| {
        if !re.is_match(text) {
            return;
        }
        let new = re.replace_all(text, |c: &Captures| {
            let whole = c.get(0).map_or("", |m| m.as_str());
            // A value that already is a marker stays as it is, and so
            // does the scheme of an `Authorization: Bearer [REDACTED]`.
            let value = c.get(keep.len() + 1).map_or("", |m| m.as_str());
            let scheme = ["bearer", "basic", "token"]
                .iter()
                .any(|w| value.eq_ignore_ascii_case(w));
            if !keep.is_empty() && (value.starts_with("[REDACTED:") || scheme) {
                return whole.to_string();
            }
            found.push(kind);
            let mut s: String = keep
                .iter()
                .map(|&i| c.get(i).map_or("", |m| m.as_str()))
                .collect();
            s.push_str(&marker(kind));
            s
        });
        *text = new.into_owned();
    };
    for (kind, re) in &p.tokens {
        apply(&mut text, re, kind, &[]);
    }
    apply(&mut text, &p.bearer, "credential", &[1, 2]);
    if env_file {
        apply(&mut text, &p.env_line, "env-value", &[1]);
    }
    apply(&mut text, &p.assignment, "secret-value", &[1, 2]);
    Redacted { text, found }
}

/// Whether `path` names a `.env`-style file (`.env`, `.env.local`,
/// `prod.env`).
pub fn is_env_file(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    name == ".env" || name.starts_with(".env.") || name.ends_with(".env")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn known_shapes_are_redacted_and_counted() {
        let text = "aws AKIAIOSFODNN7EXAMPLE here\n\
                    gh ghp_abcdefghijklmnopqrstuvwxyz0123456789 done\n\
                    curl -H 'Authorization: Bearer abc.def-ghi_jkl' x\n\
                    -----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\nabc\n-----END RSA PRIVATE KEY-----\n\
                    DB_PASSWORD=hunter2 PORT=5432\n\
                    plain words stay\n";
        let r = redact(text, false);
        for secret in [
            "AKIAIOSFODNN7EXAMPLE",
            "ghp_abcdefghijklmnopqrstuvwxyz0123456789",
            "abc.def-ghi_jkl",
            "MIIEpAIBAAKCAQEA",
            "hunter2",
        ] {
            assert!(!r.text.contains(secret), "{secret} left in {}", r.text);
        }
        assert!(
            r.text.contains("aws [REDACTED:aws-access-key] here"),
            "{}",
            r.text
        );
        assert!(
            r.text.contains("Bearer [REDACTED:credential]"),
            "{}",
            r.text
        );
        assert!(
            r.text
                .contains("DB_PASSWORD=[REDACTED:secret-value] PORT=5432"),
            "{}",
            r.text
        );
        assert!(r.text.contains("[REDACTED:private-key]\n"), "{}", r.text);
        assert!(r.text.contains("plain words stay"));
        assert_eq!(r.found.len(), 5, "{:?}", r.found);
        let note = r.note().unwrap();
        assert!(note.starts_with("[5 secret(s) redacted: "), "{note}");
        assert!(note.contains("aws-access-key"), "{note}");
        assert_eq!(redact("nothing here", false).note(), None);
    }

    #[test]
    fn env_files_lose_every_value_and_markers_are_stable() {
        let env = "# comment\nexport DATABASE_URL=postgres://u:p@h/db\nDEBUG=1\nEMPTY=\n";
        let r = redact(env, true);
        assert_eq!(
            r.text,
            "# comment\nexport DATABASE_URL=[REDACTED:env-value]\nDEBUG=[REDACTED:env-value]\nEMPTY=\n"
        );
        // Outside a .env file only secret-named values go.
        let r = redact(env, false);
        assert!(r.text.contains("DEBUG=1"), "{}", r.text);
        // Redacting twice changes nothing more.
        let once = redact("API_KEY=abc123 and AKIAIOSFODNN7EXAMPLE", false);
        let twice = redact(&once.text, false);
        assert_eq!(twice.text, once.text);
        assert!(twice.found.is_empty(), "{:?}", twice.found);
        assert!(is_env_file("/app/.env") && is_env_file(".env.local") && is_env_file("a/prod.env"));
        assert!(!is_env_file("/app/env.rs") && !is_env_file("/app/.envrc"));
    }

    #[test]
    fn an_unterminated_key_block_is_redacted_to_the_end() {
        let r = redact(
            "x\n-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXk\n",
            false,
        );
        assert_eq!(r.text, "x\n[REDACTED:private-key]");
    }
}
