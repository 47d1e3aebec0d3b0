use super::*;

fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn an_existing_file_is_kept_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.svg");
    std::fs::write(&path, "mine").unwrap();
    let e = write_file(&path, b"new", "chart", &Overwrite::default()).unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");
    assert!(create_new(&path, "recording").is_err());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "mine");
    write_file(&path, b"new", "chart", &Overwrite::ours()).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
    assert_eq!(listing(dir.path()), ["out.svg"], "no temporary file left");
}

#[test]
fn directories_fifos_and_broken_links_are_refused_even_forced() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path that lives across the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let broken = dir.path().join("broken");
    std::os::unix::fs::symlink(dir.path().join("nothing"), &broken).unwrap();
    for (path, kind) in [
        (&fifo, "FIFO"),
        (&sub, "directory"),
        (&broken, "symbolic link to nothing"),
    ] {
        let e = write_file(path, b"x", "table", &Overwrite::ours()).unwrap_err();
        assert!(matches!(e, WriteError::NotRegular { .. }), "{e}");
        assert!(e.to_string().contains(kind), "{e}");
    }
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(listing(dir.path()), ["broken", "fifo", "sub"]);
}

#[test]
fn an_input_is_refused_through_links_even_forced() {
    let dir = tempfile::tempdir().unwrap();
    let preset = dir.path().join("run.toml");
    std::fs::write(&preset, "mine").unwrap();
    let soft = dir.path().join("soft.toml");
    std::os::unix::fs::symlink(&preset, &soft).unwrap();
    let hard = dir.path().join("hard.toml");
    std::fs::hard_link(&preset, &hard).unwrap();
    let rules = Overwrite::new(true, Inputs::default().with("the preset", &preset));
    for path in [&preset, &soft, &hard] {
        let e = write_file(path, b"new", "table", &rules).unwrap_err();
        assert!(e.to_string().contains("the preset"), "{e}");
    }
    assert_eq!(std::fs::read_to_string(&preset).unwrap(), "mine");
}

#[test]
fn a_target_that_changes_before_the_rename_is_not_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out.csv");
    let pending = Pending::begin(&path, "table", &Overwrite::default()).unwrap();
    std::fs::write(&path, "made meanwhile").unwrap();
    assert!(pending.commit().is_err());
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "made meanwhile");
    let pending = Pending::begin(&path, "table", &Overwrite::ours()).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::fs::create_dir(&path).unwrap();
    let e = pending.commit().unwrap_err();
    assert!(e.to_string().contains("directory"), "{e}");
    assert_eq!(listing(dir.path()), ["out.csv"], "no temporary file left");
}

#[test]
fn a_log_is_a_regular_file_or_a_terminal_and_never_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path that lives across the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0);
    let e = open_append(&fifo, "log", &Inputs::default()).unwrap_err();
    assert!(e.to_string().contains("FIFO"), "{e}");
    let e = open_append(Path::new("/dev/null"), "log", &Inputs::default()).unwrap_err();
    assert!(e.to_string().contains("not a terminal"), "{e}");
    let log = dir.path().join("run.log");
    std::fs::write(&log, "earlier\n").unwrap();
    let mut f = open_append(&log, "log", &Inputs::default()).unwrap();
    f.write_all(b"later\n").unwrap();
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "earlier\nlater\n");
    let inputs = Inputs::default().with("the corpus", &log);
    let e = open_append(&log, "log", &inputs).unwrap_err();
    assert!(e.to_string().contains("the corpus"), "{e}");
}

#[test]
fn a_locked_directory_names_its_holder() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let held = lock_dir(&ck).unwrap();
    let e = lock_dir(&ck).unwrap_err();
    assert!(
        e.to_string()
            .contains(&format!("pid {}", std::process::id())),
        "{e}"
    );
    drop(held);
    lock_dir(&ck).unwrap();
}
