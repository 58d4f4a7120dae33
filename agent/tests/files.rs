//! The agent's file API in its test mode: paths stay inside the container
//! root, and nothing but a regular file is ever opened for reading or
//! appending.

use burrow_protocol::agent::*;
use burrow_protocol::ttrpc;

mod support;

use support::{code_of, create, creq, ctx, make_rootfs, TestAgent};

#[tokio::test]
async fn files_round_trip_and_refuse_escapes() {
    let a = TestAgent::start().await;
    let rootfs = make_rootfs(a.path());
    std::fs::write(a.path().join("secret"), "host secret").expect("secret");
    std::os::unix::fs::symlink("../secret", rootfs.join("rel-link")).expect("symlink");
    std::os::unix::fs::symlink(a.path().join("secret"), rootfs.join("abs-link")).expect("symlink");
    std::os::unix::fs::symlink("/../../../..", rootfs.join("up")).expect("symlink");
    create(&a, "f", &rootfs, &["true"], false)
        .await
        .expect("create");
    let c = "f";

    let mut mk = MakeDirRequest::new();
    mk.container_id = c.into();
    mk.path = "/work/a/b".into();
    mk.parents = true;
    a.client.make_dir(ctx(), &mk).await.expect("mkdir -p");

    let mut w = WriteFileRequest::new();
    w.container_id = c.into();
    w.path = "/work/a/b/hello.txt".into();
    w.data = b"hello files".to_vec();
    w.mode = 0o600;
    a.client.write_file(ctx(), &w).await.expect("write");
    assert_eq!(
        std::fs::read(rootfs.join("work/a/b/hello.txt")).expect("on disk"),
        b"hello files"
    );

    let mut r = ReadFileRequest::new();
    r.container_id = c.into();
    r.path = "work/a/b/hello.txt".into();
    r.offset = 6;
    r.max_bytes = 3;
    let got = a.client.read_file(ctx(), &r).await.expect("read");
    assert_eq!(
        (got.data.as_slice(), got.size, got.eof),
        (&b"fil"[..], 11, false)
    );

    let mut st = PathRequest::new();
    st.container_id = c.into();
    st.path = "/work/a/b/hello.txt".into();
    let info = a.client.stat(ctx(), &st).await.expect("stat");
    assert_eq!(
        (info.size, info.mode, info.type_.enum_value_or_default()),
        (11, 0o600, FileType::REGULAR)
    );

    let mut ls = ListDirRequest::new();
    ls.container_id = c.into();
    ls.path = "/".into();
    let list = a.client.list_dir(ctx(), &ls).await.expect("list");
    let names: Vec<&str> = list.entries.iter().map(|e| e.name.as_str()).collect();
    assert!(
        names.contains(&"work") && names.contains(&"etc") && names.contains(&"rel-link"),
        "{names:?}"
    );
    let link = list
        .entries
        .iter()
        .find(|e| e.name == "rel-link")
        .expect("rel-link");
    assert_eq!(link.type_.enum_value_or_default(), FileType::SYMLINK);
    assert_eq!(link.symlink_target, "../secret");

    // Escapes: `..`, relative and absolute symlinks all stay inside.
    for path in [
        "../secret",
        "/../../secret",
        "rel-link",
        "abs-link",
        "up/secret",
        "up/etc/marker",
    ] {
        r.path = path.into();
        r.offset = 0;
        r.max_bytes = 0;
        match a.client.read_file(ctx(), &r).await {
            Ok(got) => assert_eq!(
                got.data,
                b"marker\n",
                "{path} read {:?}",
                String::from_utf8_lossy(&got.data)
            ),
            Err(e) => {
                let (code, msg) = code_of::<()>(Err(e));
                assert_eq!(code, ttrpc::Code::NOT_FOUND, "{path}: {msg}");
            }
        }
    }
    // Writing through a link that points outside replaces the link, and
    // appending through it lands inside the root.
    w.path = "rel-link".into();
    w.data = b"inside".to_vec();
    a.client
        .write_file(ctx(), &w)
        .await
        .expect("write over link");
    w.path = "abs-link".into();
    w.append = true;
    // The link's target, taken inside the root, has no parent directory.
    let (code, msg) = code_of(a.client.write_file(ctx(), &w).await);
    assert_eq!(code, ttrpc::Code::NOT_FOUND, "{msg}");
    w.path = "up/etc/marker".into();
    a.client
        .write_file(ctx(), &w)
        .await
        .expect("append through a link to /");
    assert_eq!(
        std::fs::read(a.path().join("secret")).expect("secret"),
        b"host secret"
    );
    assert_eq!(
        std::fs::read(rootfs.join("rel-link")).expect("replaced"),
        b"inside"
    );
    assert_eq!(
        std::fs::read(rootfs.join("etc/marker")).expect("appended inside"),
        b"marker\ninside"
    );

    // Remove: a file, then a tree.
    let mut rm = RemoveRequest::new();
    rm.container_id = c.into();
    rm.path = "/work".into();
    let (code, _) = code_of(a.client.remove(ctx(), &rm).await);
    assert_eq!(
        code,
        ttrpc::Code::INVALID_ARGUMENT,
        "non-empty dir without recursive"
    );
    rm.recursive = true;
    a.client.remove(ctx(), &rm).await.expect("rm -r");
    assert!(!rootfs.join("work").exists());
    rm.path = "/".into();
    let (code, _) = code_of(a.client.remove(ctx(), &rm).await);
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT);
    a.client
        .delete_container(ctx(), &creq("f"))
        .await
        .expect("delete");
}

/// A FIFO or a device node in the container's root is refused at once: it
/// is never opened (opening a FIFO blocks until a writer comes, and opening
/// some devices acts on the guest), and the agent keeps serving.
#[tokio::test]
async fn fifos_and_devices_are_refused_without_being_opened() {
    let a = TestAgent::start().await;
    let rootfs = make_rootfs(a.path());
    nix::unistd::mkfifo(
        &rootfs.join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .expect("mkfifo");
    // /dev/null's numbers: harmless if it were opened, but still refused.
    nix::sys::stat::mknod(
        &rootfs.join("null"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o600),
        nix::sys::stat::makedev(1, 3),
    )
    .expect("mknod");
    create(&a, "g", &rootfs, &["true"], false)
        .await
        .expect("create");

    for path in ["fifo", "null", "etc"] {
        let mut r = ReadFileRequest::new();
        r.container_id = "g".into();
        r.path = path.into();
        let started = std::time::Instant::now();
        let (code, msg) = code_of(a.client.read_file(ctx(), &r).await);
        assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "read {path}: {msg}");
        assert!(msg.contains("not a regular file"), "read {path}: {msg}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "read {path} waited"
        );

        let mut w = WriteFileRequest::new();
        w.container_id = "g".into();
        w.path = path.into();
        w.data = b"x".to_vec();
        w.append = true;
        let (code, msg) = code_of(a.client.write_file(ctx(), &w).await);
        assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "append {path}: {msg}");
        assert!(msg.contains("not a regular file"), "append {path}: {msg}");
    }
    // The agent still serves, and an ordinary file still reads.
    let mut r = ReadFileRequest::new();
    r.container_id = "g".into();
    r.path = "etc/marker".into();
    assert_eq!(
        a.client.read_file(ctx(), &r).await.expect("read").data,
        b"marker\n"
    );
    a.client
        .delete_container(ctx(), &creq("g"))
        .await
        .expect("delete");
}
