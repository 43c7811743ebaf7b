use kvroute_testkit::Scratch;

use super::*;

/// Writes `text` to the file `name` in `files`; its path, to put in a config's text.
fn write(files: &Scratch, name: &str, text: &str) -> String {
    files.write(name, text).display().to_string()
}

#[test]
fn nats_credentials_and_tls_keys_are_checked_once_with_errors_naming_the_keys() {
    let files = Scratch::new("config-nats");
    let token = write(&files, "token", "tok-1\n");
    let password = write(&files, "password", "pw-1\n");
    let empty = write(&files, "empty", "\n");
    let ca = write(&files, "ca.pem", "");
    let base = "nats = \"tls://127.0.0.1:4222\"\n";
    // (extra TOML, the error's start, or "" when accepted)
    let cases: Vec<(String, &str)> = vec![
        (String::new(), ""),
        ("nats-token = \"tok-1\"\n".into(), ""),
        (format!("nats-token-file = \"{token}\"\n"), ""),
        ("nats-user = \"r\"\nnats-password = \"pw-1\"\n".into(), ""),
        (
            format!("nats-user = \"r\"\nnats-password-file = \"{password}\"\n"),
            "",
        ),
        (format!("nats-tls-ca = \"{ca}\"\n"), ""),
        (
            format!("nats-tls-ca = \"{ca}\"\nnats-tls-cert = \"{ca}\"\nnats-tls-key = \"{ca}\"\n"),
            "",
        ),
        (
            format!("nats-token = \"t\"\nnats-token-file = \"{token}\"\n"),
            "nats-token/nats-token-file: give nats-token or nats-token-file, not both",
        ),
        (
            "nats-token = \"t\"\nnats-user = \"r\"\nnats-password = \"p\"\n".into(),
            "nats-token/nats-user: one way to authenticate",
        ),
        (
            "nats-token = \"t\"\nnats-credentials = \"/x.creds\"\n".into(),
            "nats-token/nats-credentials: one way",
        ),
        (
            "nats-user = \"r\"\n".into(),
            "nats-password: required with nats-user",
        ),
        (
            "nats-password = \"p\"\n".into(),
            "nats-user: required with nats-password",
        ),
        (
            format!("nats-token-file = \"{empty}\"\n"),
            "nats-token-file: must not be empty",
        ),
        (
            "nats-token-file = \"/no/such/token\"\n".into(),
            "nats-token-file: /no/such/token:",
        ),
        (
            "nats-credentials = \"/no/such.creds\"\n".into(),
            "nats-credentials: /no/such.creds:",
        ),
        (
            "nats-tls-ca = \"/no/ca.pem\"\n".into(),
            "nats-tls-ca: /no/ca.pem: no such file",
        ),
        (
            format!("nats-tls-cert = \"{ca}\"\n"),
            "nats-tls-key: required with nats-tls-cert",
        ),
        (
            format!("nats-tls-key = \"{ca}\"\n"),
            "nats-tls-cert: required with nats-tls-key",
        ),
        (
            "peer-worker-api-key = \"two words\"\n".into(),
            "peer-worker-api-key:",
        ),
        ("peer-worker-api-key = \"sk-1\"\n".into(), ""),
    ];
    for (extra, want) in &cases {
        let text = format!("{base}{extra}");
        let result = ServeConfig::from_toml_str(&text).and_then(|c| c.validate().map(|_| c));
        match result {
            Ok(_) => assert!(want.is_empty(), "{text}: accepted"),
            Err(e) => {
                let e = e.to_string();
                assert!(!want.is_empty() && e.starts_with(want), "{text}: {e}");
                for secret in ["tok-1", "pw-1", "sk-1"] {
                    assert!(!e.contains(secret), "{text}: the error repeats a secret: {e}");
                }
            }
        }
    }
    // Without a server, its keys mean nothing.
    let err = ServeConfig::from_toml_str("nats-token = \"t\"\n")
        .unwrap()
        .validate()
        .unwrap_err();
    assert!(err.to_string().starts_with("nats-token: needs nats"), "{err}");
    let err = ServeConfig::from_toml_str("nats = \"nats://u:p@h:4222\"\n")
        .unwrap()
        .validate()
        .unwrap_err();
    assert!(err.to_string().contains("credentials in it"), "{err}");
    assert!(
        ServeConfig::from_toml_str("nats-tokn = \"t\"\n").is_err(),
        "unknown keys refused"
    );
}

#[test]
fn the_transport_gets_typed_credentials_and_tls_and_debug_output_hides_secrets() {
    let files = Scratch::new("config-typed");
    let password = write(&files, "password", "pw-2\r\n");
    let ca = write(&files, "ca.pem", "");
    let c = ServeConfig::from_toml_str(&format!(
        "nats = \"nats://127.0.0.1:4222\"\nnats-user = \"r\"\nnats-password-file = \"{password}\"\n\
         nats-tls-ca = \"{ca}\"\npeer-worker-api-key = \"sk-2\"\n"
    ))
    .unwrap();
    c.validate().unwrap();
    let sync = c.sync_config().unwrap().unwrap();
    assert_eq!(
        sync.auth,
        NatsAuth::UserPassword {
            user: "r".into(),
            password: Secret::new("pw-2")
        },
        "the file's first line, without its line end"
    );
    assert!(sync.tls.required, "a CA implies TLS");
    assert_eq!(sync.tls.ca, Some(PathBuf::from(&ca)));
    let shown = format!("{c:?} {sync:?}");
    assert!(!shown.contains("pw-2") && !shown.contains("sk-2"), "{shown}");
    let plain = ServeConfig::from_toml_str("nats = \"nats://127.0.0.1:4222\"\n").unwrap();
    let sync = plain.sync_config().unwrap().unwrap();
    assert_eq!((sync.auth, sync.tls), (NatsAuth::None, NatsTls::default()));
    let tls = ServeConfig::from_toml_str("nats = \"tls://127.0.0.1:4222\"\n").unwrap();
    assert!(
        tls.sync_config().unwrap().unwrap().tls.required,
        "a tls:// URL requires TLS"
    );
}
